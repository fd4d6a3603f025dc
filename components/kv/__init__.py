from components.kv.base import KVManager

__all__ = ["KVManager"]
