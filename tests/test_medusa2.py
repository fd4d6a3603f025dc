"""Medusa-2 (heads=medusa2): the conversation batches follow the offset convention, LoRA merges to
the model it computes, warm-up leaves the backbone alone and joint steps move it, the written
backbone reloads bit for bit, and tree_medusa on it equals its own greedy."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from components.data.self_distill import generate_batch
from components.heads.medusa import FORMAT as MEDUSA
from components.heads.medusa2 import (LoRADense, conversation_batch, dense_weights, drift, float32_copy,
                                      trainable_copy)
from components.model.load import Backbone, from_pretrained

from helpers import compose_config

TRAIN = ["heads=medusa2", "model=tiny", "data.max_samples=24", "data.max_new_tokens=12", "data.gen_batch_size=12",
         "heads.draft_vocab=null", "~logger", "module.warmup_steps=3", "module.drift_prompts=4",
         "module.drift_tokens=16"]


def run_training(root, *overrides):
    from pipeline.train import train
    cfg = compose_config([*TRAIN, f"data.root={root / 'data'}", *overrides], config_name="train",
                         output_dir=root / "run")
    return train(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three warm-up (heads-only) steps, the backbone written; then the same run resumed to six
    steps, three of them joint."""
    root = tmp_path_factory.mktemp("medusa2")
    warm_metrics, warm = run_training(root, "trainer.max_steps=3")
    shutil.copytree(root / "run" / "backbone", root / "warm_backbone")
    joint_metrics, joint = run_training(root, "trainer.max_steps=6")
    return root, (warm_metrics, warm), (joint_metrics, joint)


def header(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[MEDUSA.key])


def test_conversation_targets_follow_the_offset_convention():
    # prompt [1, 2, 3], answer [10, 11, 12]: position 2 (the prompt's last) predicts y_1 = 10
    tokens, targets = conversation_batch([(torch.tensor([1, 2, 3, 10, 11, 12]), 3), (torch.tensor([5, 20, 21]), 1)], 2)
    assert tokens.tolist() == [[1, 2, 3, 10, 11, 12], [5, 20, 21, 0, 0, 0]]
    assert targets[0, :, 0].tolist() == [-100, -100, 10, 11, 12, -100]  # the backbone's head: t+1
    assert targets[0, :, 1].tolist() == [-100, -100, 11, 12, -100, -100]  # head 1: t+2
    assert targets[0, :, 2].tolist() == [-100, -100, 12, -100, -100, -100]  # head 2: t+3
    assert targets[1, :, 0].tolist() == [20, 21, -100, -100, -100, -100]
    assert targets[1, :, 2].tolist() == [-100] * 6


def test_conversations_pair_each_answer_with_its_prompt(runs):
    """Every conversation's answer is the original's greedy answer to its own prompt (the split and
    the prompt order are the data's)."""
    _, (_, warm), _ = runs
    conv, backbone = warm["module"].fit_data, warm["backbone"]
    assert len(conv.train_items) == warm["data"].train_set.samples and len(conv.val_items) == warm["data"].val_set.samples
    items = conv.train_items[:3] + conv.val_items[:2]
    out = generate_batch(backbone, [ids[:P].tolist() for ids, P in items], 12)
    assert [ids[P:].tolist() for ids, P in items] == [a for a, _ in out]


def test_lora_merges_to_the_same_outputs(tiny_backbone):
    model = trainable_copy(tiny_backbone.model, "lora", rank=4, alpha=8.0, targets=["wqkv", "w2"])
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)  # the base matrices, norms, embedding stay frozen
    tokens = torch.randint(0, model.args.vocab_size, (2, 9))
    pos = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        assert torch.equal(model.logits(model(tokens, pos)), tiny_backbone.model.logits(tiny_backbone.model(tokens, pos)))
        for m in model.modules():
            if isinstance(m, LoRADense):
                m.lora_b.normal_(std=0.05)
        merged = float32_copy(model)
        assert not any(isinstance(m, LoRADense) for m in merged.modules())
        lora_out, merged_out = model.logits(model(tokens, pos)), merged.logits(merged(tokens, pos))
        assert not torch.allclose(lora_out, tiny_backbone.model.logits(tiny_backbone.model(tokens, pos)), atol=1e-3)
    torch.testing.assert_close(merged_out, lora_out, atol=1e-4, rtol=1e-4)


def test_bad_finetune_options_fail_with_the_key():
    from components.model.load import tiny
    with pytest.raises(ValueError, match="module.finetune"):
        trainable_copy(tiny().model, "half")
    with pytest.raises(ValueError, match="module.lora.targets"):
        trainable_copy(tiny().model, "lora", targets=["wq"])


def test_warmup_leaves_the_backbone_and_joint_steps_move_it(runs, tiny_backbone):
    root, (warm_metrics, _), (joint_metrics, joint) = runs
    original = dense_weights(tiny_backbone.model)
    warm = dense_weights(from_pretrained(str(root / "warm_backbone"), dtype="float32", native=False).model)
    assert all(torch.equal(warm[k], v) for k, v in original.items())
    assert warm_metrics["val/backbone_kl"] == 0.0  # the same model: KL(p || p)
    tuned = dense_weights(joint["module"].backbone_model)
    moved = [k for k in original if not torch.equal(tuned[k], original[k])]
    assert any(".wqkv." in k for k in moved) and any(".w2." in k for k in moved)
    frozen = ("tok_embeddings.weight", "lm_head", "norm.weight")  # LoRA trains the block matrices alone
    assert not any(k in moved for k in frozen) and not any("norm" in k for k in moved)
    assert joint_metrics["steps"] == 6 and joint_metrics["val/backbone_kl"] > 0
    for k in ("val/greedy_match", "val/greedy_prefix", "val/head1_top1", "val/backbone_top1"):
        assert 0 <= joint_metrics[k] <= 1, k


def test_written_backbone_reloads_bit_identically(runs):
    root, _, (joint_metrics, joint) = runs
    run = root / "run"
    reloaded = from_pretrained(str(run / "backbone"), dtype="float32", native=False)
    mine, theirs = dense_weights(joint["module"].backbone_model), dense_weights(reloaded.model)
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert reloaded.model.args == joint["module"].backbone_model.args
    info = header(run / "heads.safetensors")
    assert info["fingerprint"] == reloaded.model.fingerprint() != info["base_fingerprint"]
    assert info["base_fingerprint"] == joint["backbone"].model.fingerprint() and info["finetune"] == "lora"
    assert json.loads((run / "metrics.json").read_text()) == joint_metrics


def test_tree_medusa_on_the_written_backbone_equals_its_greedy(runs, tmp_path):
    from pipeline.decode import decode
    root, _, _ = runs
    run = root / "run"
    cfg = compose_config(["decode=tree_medusa", f"model.path={run / 'backbone'}", "model.dtype=float32",
                          f"proposer.checkpoint={run / 'heads.safetensors'}", "proposer.tree_file=null",
                          "tree.width=2", "tree.depth=3", "tree.max_nodes=8", "prompt=hello there",
                          "max_new_tokens=40", "stream=false", "verify_lossless=true"], output_dir=tmp_path)
    metrics, objs = decode(cfg)
    assert metrics["lossless"], objs["results"]["items"][0]
    assert metrics["steps"] < 40  # the heads did draft something


def test_full_finetuning_trains_the_blocks_and_leaves_the_embedding(tmp_path, tiny_backbone):
    _, objs = run_training(tmp_path, "module.finetune=full", "module.warmup_steps=1", "trainer.max_steps=3",
                           "module.backbone_lr=1e-2", "module.drift_prompts=0")
    original, tuned = dense_weights(tiny_backbone.model), dense_weights(objs["module"].backbone_model)
    moved = {k for k in original if not torch.equal(tuned[k], original[k])}
    assert {"layers.0.wqkv.weight", "layers.1.attn_norm.weight", "norm.weight"} <= moved
    assert not moved & {"tok_embeddings.weight", "lm_head"}
    assert header(tmp_path / "run" / "heads.safetensors")["finetune"] == "full"


def test_drift_is_nil_against_itself_and_seen_otherwise(tiny_backbone):
    tok = tiny_backbone.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("hello there", "one two three", "a b a b")]
    same = drift(tiny_backbone, tiny_backbone, prompts, 12)
    assert same["greedy_match"] == same["greedy_prefix"] == 1.0 and same["kl"] == 0.0
    other = float32_copy(tiny_backbone.model)
    with torch.no_grad():
        for p in other.layers.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    moved = drift(tiny_backbone, Backbone(other, tok, "moved"), prompts, 12)
    assert moved["greedy_prefix"] < 1.0 and moved["kl"] > 0


def test_drift_of_a_run_compares_with_the_original_it_started_from(runs, tmp_path):
    """The run's own model config is the original: a backbone written after the warm-up alone has
    drifted nowhere on the prompts after the training set; the joint one is measured on the same."""
    from components.heads.medusa2 import drift_of_run
    root, _, _ = runs
    shutil.copytree(root / "warm_backbone", tmp_path / "backbone")
    shutil.copy(root / "run" / "train_config.yaml", tmp_path)
    warm = drift_of_run(tmp_path, prompts=3, max_new_tokens=12)
    # the two float32 loads time their own matmul kernels (float32 is never batch-invariant, and the
    # fastest kernel per row count may differ between loads): last bits, not drift
    assert warm["greedy_match"] == warm["greedy_prefix"] == 1.0 and warm["kl"] < 1e-6 and warm["prompts"] == 3
    joint = drift_of_run(root / "run", prompts=3, max_new_tokens=12)
    assert joint["kl"] > 1e-4
