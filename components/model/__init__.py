from components.model.llama import LlamaArgs, Transformer

__all__ = ["LlamaArgs", "Transformer"]
