"""The core: the types and interfaces every component implements or reads, the target-distribution
stage, and the engine that runs the step loop over many sequences. Components import from here and
nowhere else in `pipeline`; the core names no concrete component."""
from pipeline.errors import UserError, positive_int
from pipeline.io import append_jsonl, atomic_write, write_json
from pipeline.core.tree import StaticTree, Tree, dynamic_tree
from pipeline.core.types import Accepted, DecodeState, Generation, KVPlan, StepBatch
from pipeline.core.target import Target, TargetStage
from pipeline.core.protocols import Constraint, Grammar, KVManager, LogitsProcessor, Proposer, Sampler, Verifier
from pipeline.core.chat import encode_chat
from pipeline.core.runner import Request, Runner, SamplingParams
from pipeline.core.engine import Engine, forward_rows, forward_step
from pipeline.core.beam import BeamSearch

__all__ = ["Accepted", "BeamSearch", "Constraint", "DecodeState", "Engine", "Generation", "Grammar", "KVManager", "KVPlan", "LogitsProcessor",
           "Proposer", "Request", "Runner", "Sampler", "SamplingParams", "StaticTree", "StepBatch", "Target", "TargetStage", "Tree", "UserError",
           "Verifier", "append_jsonl", "atomic_write", "dynamic_tree", "encode_chat", "forward_rows", "forward_step", "positive_int", "write_json"]
