"""EAGLE drafts exported in vLLM's layouts (`python -m pipeline.export <draft> <dir> --format eagle`):
the files carry vLLM's names and config keys, a reader gets our draft back from them (the same
drafts, tree for tree), the export says what does not map, and where vLLM is installed it loads
the draft beside the bf16 backbone, stays lossless and accepts what ours accepts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from components.heads.eagle import EagleDraft
from components.proposer.eagle import shipped_draft
from pipeline.build import build_engine
from pipeline.core import encode_chat
from pipeline.errors import UserError
from pipeline.export import EXTRAS, export_eagle, read_eagle
from pipeline import vllm_peer

from helpers import REPO_ROOT, compose_config, subprocess_env

TRAIN = ["model=tiny", "heads=eagle", "data.max_samples=24", "data.max_new_tokens=16", "data.gen_batch_size=12",
         "data.answers_per_batch=4", "heads.draft_vocab=512", "trainer.max_steps=8", "~logger"]
PROMPTS = ["one two three one two three", "hello there", "the cat sat on the mat, the cat", "a b a b a b"]
EAGLE1_NAMES = {"model.fc.weight", "model.norm.weight", *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"}


def trained_draft(root: Path, *extra: str) -> Path:
    from pipeline.train import train
    cfg = compose_config([*TRAIN, *extra, f"data.root={root / 'data'}"], config_name="train", output_dir=root / "run")
    train(cfg)
    return root / "run" / "heads.safetensors"


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_backbone):
    """A few-step-trained tiny draft, unfused and fused (EAGLE-3's auto layers: 0, 1 and 2)."""
    root = tmp_path_factory.mktemp("export")
    try:
        return {"eagle": trained_draft(root / "plain"),
                "eagle3": trained_draft(root / "fused", "heads.fuse_layers=auto", "module.unroll=2")}
    finally:
        tiny_backbone.model.tap(())


def trees_of(checkpoint: Path, backbone, prompts: list[str], *overrides: str, model: str = "model=tiny",
             max_new_tokens: int = 24):
    """Greedy tree_eagle on the prompts, every verified tree recorded: [(tokens, trees, accepted
    lengths)] per prompt."""
    cfg = compose_config([model, "decode=tree_eagle", f"proposer.checkpoint={checkpoint}", "proposer.nodes=null",
                          f"max_new_tokens={max_new_tokens}", *overrides])
    try:
        engine = build_engine(cfg, backbone)[0]
        engine.record_trees = True
        ids = [encode_chat(backbone.tokenizer, None, p, True) for p in prompts]
        return [(g.token_ids, g.trees, g.accepted_lengths) for g in engine.run(ids)]
    finally:
        backbone.model.tap(())


def assert_same_draft(original: EagleDraft, back: EagleDraft) -> None:
    """Every tensor of ours read back as it was stored (bfloat16 checkpoints: the float32 folds and
    un-folds in between round to the same bits)."""
    a, b = original.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        x, y = (a[k].bfloat16(), b[k].bfloat16()) if a[k].is_floating_point() else (a[k], b[k])
        assert torch.equal(x, y), k
    assert back.fuse_layers == original.fuse_layers


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_exported_draft_reads_back_to_the_same_trees(drafts, tiny_backbone, tmp_path, kind):
    path = drafts[kind]
    out, method, lost = export_eagle(str(path), str(tmp_path / "vllm"), tiny_backbone)
    assert method == kind and lost
    back = read_eagle(out, tiny_backbone)
    assert_same_draft(EagleDraft.load(path, tiny_backbone), back)
    again = back.save(tmp_path / "back.safetensors", {k: v for k, v in back.info.items() if k != "format"})
    overrides = ("tree.width=3", "tree.depth=4", "tree.max_nodes=10")
    ours, theirs = trees_of(path, tiny_backbone, PROMPTS, *overrides), trees_of(again, tiny_backbone, PROMPTS, *overrides)
    assert ours == theirs and any(trees for _, trees, _ in ours)  # trees were drafted, and they are the same


def test_eagle1_layout_is_vllms(drafts, tiny_backbone, tmp_path):
    """The unfused draft: vLLM's EagleMistralForCausalLM names (a Llama block with both norms, a
    final norm), fc over concat(embed, feature) (ours is concat(feature, embed))."""
    path = drafts["eagle"]
    out, _, lost = export_eagle(str(path), str(tmp_path / "vllm"), tiny_backbone)
    draft, dim = EagleDraft.load(path, tiny_backbone), tiny_backbone.model.args.dim
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert set(t) == EAGLE1_NAMES
    fc = draft.fc.weight.float()
    assert torch.equal(t["model.fc.weight"], torch.cat((fc[:, dim:], fc[:, :dim]), dim=1))
    q = draft.block.wqkv.dense().float().t()[:t["model.layers.0.self_attn.q_proj.weight"].shape[0]]
    assert torch.equal(t["model.layers.0.self_attn.q_proj.weight"], q)
    assert torch.equal(t["model.layers.0.input_layernorm.weight"], draft.block.attn_norm.weight.float())
    assert torch.equal(t["model.norm.weight"], draft.norm.weight.float())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["sliding_window"] is None and cfg["hidden_size"] == dim and cfg["llm_decode"]["not_exact"] == lost
    assert [line.split(":")[0] for line in lost] == ["draft vocabulary", "context"]
    assert (out / EXTRAS).is_file() and not list(out.glob("*.bin"))


def test_eagle3_layout_is_vllms(drafts, tiny_backbone, tmp_path):
    """The fused draft: vLLM's EAGLE-3 keys, fc = our fusion over the layers in vLLM's order, the
    draft vocabulary as d2t (draft id + d2t = target id) and t2d, our final norm and LM head rows."""
    path = drafts["eagle3"]
    out, _, lost = export_eagle(str(path), str(tmp_path / "vllm"), tiny_backbone)
    draft = EagleDraft.load(path, tiny_backbone)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert ids == sorted(draft.fuse_layers) == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["draft_vocab_size"] == len(draft.vocab_ids) == 512 and cfg["norm_output"]
    assert torch.equal(t["fc.weight"], draft.fuse.weight.float())  # auto layers are already in order
    assert torch.equal(torch.arange(512) + t["d2t"], draft.vocab_ids) and int(t["t2d"].sum()) == 512
    assert torch.equal(t["t2d"].nonzero()[:, 0], draft.vocab_ids.sort().values)
    assert torch.equal(t["lm_head.weight"], draft.lm_weight) and torch.equal(t["norm.weight"], draft.norm.weight.float())
    dim = tiny_backbone.model.args.dim
    assert t["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * dim  # over concat(embeds, hidden)
    assert [line.split(":")[0] for line in lost] == ["input projection", "context"]


def test_reader_refuses_a_folder_that_is_not_ours(tmp_path, tiny_backbone):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="--format eagle"):
        read_eagle(tmp_path, tiny_backbone)


def test_cli_says_what_does_not_map(drafts, tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline.export", str(drafts["eagle"]), str(tmp_path / "out"),
                        "--format", "eagle"], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "method=eagle" in r.stderr and r.stderr.count("not exact: ") == 2


def test_vllm_options_for_our_draft(drafts, tiny_backbone, tmp_path):
    out, _, _ = export_eagle(str(drafts["eagle"]), str(tmp_path / "vllm"), tiny_backbone)
    cfg = vllm_peer.speculative_config({"speculative": "eagle", "draft": str(out)})
    assert cfg == {"method": "eagle", "model": str(out), "num_speculative_tokens": 3}
    with pytest.raises(UserError, match="speculative=eagle"):
        vllm_peer.speculative_config({"speculative": "eagle3", "draft": str(out)})
    with pytest.raises(UserError, match="n-gram"):
        vllm_peer.speculative_config({"speculative": "eagle", "draft": str(out), "prompt_lookup_max": 3})
    with pytest.raises(UserError, match="draft="):
        vllm_peer.speculative_config({"speculative": "ngram", "draft": str(out)})


def test_shipped_draft_reads_back_on_the_real_model(real_backbone, tmp_path):
    path = shipped_draft("smollm2_135m")
    out, method, _ = export_eagle(str(path), str(tmp_path / "vllm"), real_backbone)
    back = read_eagle(out, real_backbone)
    assert method == "eagle"
    assert_same_draft(EagleDraft.load(path, real_backbone), back)


@torch.no_grad()
def vllm_eagle1_tops(folder: Path, backbone, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's EAGLE-1 Mistral draft (mistral_eagle.py) written out on the exported tensors, teacher-forced
    over ids (1, T + 1): its top token and its output feature at each position (depth 1)."""
    from components.model.llama import apply_rope
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    model, a = backbone.model, backbone.model.args
    T = ids.shape[1] - 1
    feats = model(ids, torch.arange(T + 1)[None])[:, :-1]  # the target's last states after its norm
    rms_norm = torch.nn.functional.rms_norm
    x = torch.cat((model.tok_embeddings.weight.float()[ids[:, 1:]], feats), dim=-1) @ t["model.fc.weight"].t()
    p = "model.layers.0."
    lin = lambda n, z: z @ t[p + n + ".weight"].t()  # noqa: E731
    draft = EagleDraft(a, torch.arange(4), backbone.model.lm_head.t()[:4], model.tok_embeddings.weight)
    cos, sin = draft.rope(torch.arange(T)[None])
    xn = rms_norm(x, (a.dim,), t[p + "input_layernorm.weight"], a.norm_eps)
    q = apply_rope(lin("self_attn.q_proj", xn).view(1, T, a.n_heads, a.head_dim), cos, sin)
    k = apply_rope(lin("self_attn.k_proj", xn).view(1, T, a.n_kv_heads, a.head_dim), cos, sin)
    v = lin("self_attn.v_proj", xn).view(1, T, a.n_kv_heads, a.head_dim)
    y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True).transpose(1, 2).reshape(1, T, -1)
    h = x + lin("self_attn.o_proj", y)
    m = rms_norm(h, (a.dim,), t[p + "post_attention_layernorm.weight"], a.norm_eps)
    out = rms_norm(h + lin("mlp.down_proj", torch.nn.functional.silu(lin("mlp.gate_proj", m)) * lin("mlp.up_proj", m)),
                   (a.dim,), t["model.norm.weight"], a.norm_eps)
    return (out @ model.lm_head.float()).argmax(-1)[0], out[0]  # the target's head over the full vocabulary


def test_vllm_eagle1_arithmetic_drafts_our_tokens(real_backbone, tmp_path):
    """The exported draft run as vLLM's EAGLE-1 code runs it (written out here: CI has no vLLM) is
    ours: the same predicted feature, and our depth-1 token wherever ours is also the full
    vocabulary's top (the one thing that does not map)."""
    path = shipped_draft("smollm2_135m")
    out, _, _ = export_eagle(str(path), str(tmp_path / "vllm"), real_backbone)
    draft = EagleDraft.load(path, real_backbone)
    ids = torch.tensor(encode_chat(real_backbone.tokenizer, None, bench_prompts(1)[0], True))[None]
    tops, feat = vllm_eagle1_tops(out, real_backbone, ids)
    with torch.no_grad():
        states = real_backbone.model(ids, torch.arange(ids.shape[1])[None])[:, :-1]
        pred = draft(states, ids[:, 1:])[0]
        ours = draft.vocab_ids[draft.logits(pred).argmax(-1)]
        full = (pred @ real_backbone.model.lm_head.float()).argmax(-1)
    torch.testing.assert_close(feat, pred, atol=1e-4, rtol=1e-4)
    assert torch.equal(tops, full) and (tops == ours).float().mean() > 0.9


def bench_prompts(n: int) -> list[str]:
    lines = (REPO_ROOT / "pipeline" / "prompts" / "bench.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def mean_accepted(gens) -> float:
    """Tokens committed per step after the prefill's, over all the prompts."""
    steps = [a for g in gens for a in g[2][1:]]
    return sum(steps) / len(steps)


@pytest.mark.skipif(not vllm_peer.available(), reason="vLLM is not installed (.venv-vllm): make peer-vllm")
def test_vllm_decodes_with_our_draft_losslessly_and_accepts(real_backbone, tmp_path):
    """vLLM's greedy with our draft (3 drafted tokens, a chain) equals its greedy without, up to
    vLLM's own batch variance (see `_same_or_bf16_tie`), and it
    accepts what ours accepts drafting a chain of 3 on the same prompts (measured: vLLM 1.60 tokens a
    step, ours 1.58; a wrongly mapped draft accepts ~nothing: 1.01 in the Llama EAGLE class)."""
    from omegaconf import OmegaConf
    prompts, k, n = bench_prompts(3), 3, 32
    ids = [encode_chat(real_backbone.tokenizer, None, p, True) for p in prompts]
    model_cfg = OmegaConf.create({"_target_": "components.model.load.from_pretrained", "path": None})
    folder = vllm_peer.hf_folder(model_cfg, real_backbone, tmp_path)
    spec = vllm_peer.speculative_config({"speculative": "eagle", "num_speculative_tokens": k})
    runs = {}
    for name, s in (("plain", None), ("eagle", spec)):
        peer = vllm_peer.VllmPeer(folder, real_backbone.eos_ids, n, 1024, speculative=s, eager=True,
                                  log_path=tmp_path / f"{name}.log")
        try:
            runs[name] = peer.run(ids)
        finally:
            peer.close()
    for prompt, e, g in zip(ids, runs["eagle"], runs["plain"]):
        _same_or_bf16_tie(real_backbone, prompt, e.token_ids, g.token_ids)
    theirs = mean_accepted([(None, None, g.accepted_lengths) for g in runs["eagle"]])
    ours = mean_accepted(trees_of(shipped_draft("smollm2_135m"), real_backbone, prompts, "tree.width=1",
                                  f"tree.depth={k}", f"tree.max_nodes={k + 1}", model="model.dtype=float32", max_new_tokens=n))
    print(f"mean accepted length over {len(prompts)} bench prompts, {k} drafted: vLLM {theirs:.2f}, ours {ours:.2f}")
    assert ours > 1.2 and theirs > 1 + 0.7 * (ours - 1)  # bfloat16 and the full vocabulary move a few drafts


def _same_or_bf16_tie(backbone, prompt: list[int], a: list[int], b: list[int]) -> None:
    """a == b, or they part where the target's two choices are within bfloat16 rounding of each
    other: vLLM's bfloat16 products are not batch-invariant, so verifying k + 1 rows may flip such a
    near-tie (seen on an AMD Zen 5: float32 logits 18.11 vs 18.05, a bfloat16 ulp there is 0.125).
    A parting anywhere else is a wrong verification, and fails."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        assert len(a) == len(b)
        return
    x = torch.tensor([prompt + a[:i]])
    with torch.no_grad():
        lg = backbone.model.logits(backbone.model(x, torch.arange(x.shape[1])[None])[0, -1])
    assert lg.argmax().item() in (a[i], b[i]), f"at token {i}, neither {a[i]} nor {b[i]} is the target's greedy"
    ulp = 2.0 ** (torch.floor(torch.log2(lg.max().abs())).item() - 7)  # bfloat16 spacing at the top logit
    assert abs(lg[a[i]] - lg[b[i]]).item() < ulp, f"vLLM's runs part at token {i} on no near-tie"

