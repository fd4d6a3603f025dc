"""EAGLE-3 feature fusion (`heads.fuse_layers`): the backbone keeps the requested layers' states in
its normal forward (no extra one), the data stores them (equal to a plain forward's), a fused draft
trains through the training-time test and decodes losslessly with them, and the unfused draft is
unchanged, even beside a backbone that keeps layers for another draft."""
from __future__ import annotations

import functools

import pytest
import torch

from components.data.prompts import training_prompts
from components.data.self_distill import build_self_distill
from components.heads.eagle import FORMAT as EAGLE
from components.heads.eagle import EagleDraft, build_eagle, resolve_fuse_layers
from components.kv.contiguous import ContiguousKV
from components.proposer.eagle import EagleProposer
from pipeline.core import StepBatch, encode_chat, forward_step
from pipeline.errors import UserError

from helpers import assert_saved_state, compose_config

TRAIN = ["model=tiny", "heads=eagle", "heads.fuse_layers=auto", "data.max_samples=24", "data.max_new_tokens=16",
         "data.gen_batch_size=12", "data.answers_per_batch=4", "heads.draft_vocab=null", "~logger"]
PROMPTS = ["one two three one two three", "hello there", "the cat sat on the mat, the cat", "a b a b a b"]


@pytest.fixture
def untapped(tiny_backbone):
    """A test that builds a fused proposer leaves the shared backbone as it found it."""
    yield tiny_backbone
    tiny_backbone.model.tap(())


@pytest.fixture(scope="module")
def fused(tmp_path_factory, tiny_backbone):
    from pipeline.train import train
    root = tmp_path_factory.mktemp("eagle3")
    cfg = compose_config([*TRAIN, "trainer.max_steps=8", "module.unroll=2", f"data.root={root / 'data'}"],
                         config_name="train", output_dir=root / "run")
    metrics, objs = train(cfg)
    tiny_backbone.model.tap(())
    return root / "run" / "heads.safetensors", metrics, objs, root / "data"


def test_fuse_layers_auto_takes_eagle3s_low_middle_and_high_layers():
    assert resolve_fuse_layers("auto", 30) == (2, 15, 27)  # SmolLM2-135M
    assert resolve_fuse_layers("auto", 32) == (2, 16, 29)
    assert resolve_fuse_layers("auto", 2) == (0, 1, 2)  # model=tiny: every state there is
    assert resolve_fuse_layers(None, 30) is None and resolve_fuse_layers([3, 7], 30) == (3, 7)
    for bad in ([31], [2, 2], "low", []):
        with pytest.raises(UserError, match="fuse_layers"):
            resolve_fuse_layers(bad, 30)


def test_tapped_layers_are_the_blocks_inputs(tiny_backbone):
    """tap i is the state entering block i (Hugging Face's hidden_states[i]): tap 0 the embedding,
    tap n_layers normed is the forward's output; a cached step keeps the cache-free forward's."""
    model, dim = tiny_backbone.model, tiny_backbone.model.args.dim
    toks = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        plain = model(toks, torch.arange(9)[None])
        try:
            model.tap((0, 1, 2))
            h = model(toks, torch.arange(9)[None])
            taps = model.tapped  # (1, 9, 3 dim)
            kv = ContiguousKV(tiny_backbone, 16)
            step = StepBatch.build([kv.create()], [toks[0]], [None], [None], [0], model.attn_dtype)
            h_step = forward_step(model, kv, step)
            taps_step = model.tapped  # (9, 3 dim)
        finally:
            model.tap(())
    assert torch.equal(h, plain) and taps.shape == (1, 9, 3 * dim)  # keeping states changes nothing else
    torch.testing.assert_close(taps[..., :dim], model.tok_embeddings(toks))
    torch.testing.assert_close(model.norm(taps[..., 2 * dim:]), h)
    torch.testing.assert_close(taps_step, taps[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_step, h[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="0..2"):
        model.tap((3,))


def test_fused_data_is_the_targets_states_at_those_layers(fused, tiny_backbone):
    """Each stored state is [the fused layers' states | the last], recorded while decoding (batched,
    cached), equal to a plain forward over prompt + answer; the last part is the unfused set's
    exactly, and the unfused set keeps its directory."""
    _, _, objs, root = fused
    model, dim = tiny_backbone.model, tiny_backbone.model.args.dim
    kw = dict(max_samples=24, max_new_tokens=16, batch_size=12, root=str(root))
    ds = build_self_distill(tiny_backbone, fuse_layers=(0, 1, 2), **kw)
    plain = build_self_distill(tiny_backbone, **kw)
    assert ds.hidden.shape[1] == 4 * dim and plain.hidden.shape[1] == dim
    assert torch.equal(ds.tokens, plain.tokens) and torch.equal(ds.hidden[:, -dim:], plain.hidden)
    prompts = training_prompts(24)
    for s in (0, 13, 23):
        a, b = int(ds.offsets[s]), int(ds.offsets[s + 1])
        prompt = encode_chat(tiny_backbone.tokenizer, None, prompts[s], True)
        seq = torch.tensor(prompt + ds.tokens[a:b - 1].tolist())[None]
        try:
            model.tap((0, 1, 2))
            with torch.no_grad():
                h = model(seq, torch.arange(seq.shape[1])[None])
            ref = torch.cat((model.tapped, h), dim=-1)[0, len(prompt) - 1:]  # the states that chose the answer
        finally:
            model.tap(())
        torch.testing.assert_close(ds.hidden[a:b].float(), ref, atol=2e-2, rtol=1e-2)  # stored in bfloat16
    assert len([p for p in root.iterdir() if p.is_dir()]) == 2  # another config key, another set


def test_fused_draft_trains_on_tokens_and_saves_its_layers(fused, tiny_backbone):
    path, metrics, objs, _ = fused
    draft = objs["heads"]
    assert draft.fused and draft.fuse_layers == (0, 1, 2) and draft.fuse.weight.shape == (64, 192)
    assert objs["module"].feature_weight == 0.0  # EAGLE-3: no feature regression unless asked
    # it trained on [the fused layers' states | the last]: data.fuse_layers follows heads.fuse_layers
    assert objs["data"].train_set.hidden.shape[-1] == 4 * tiny_backbone.model.args.dim
    assert_saved_state(path, draft, EAGLE.frozen, torch.bfloat16)
    loaded = EagleDraft.load(path, tiny_backbone)
    assert loaded.info["fuse_layers"] == [0, 1, 2] and loaded.fuse_layers == (0, 1, 2)
    assert metrics["steps"] == 8 and 1.0 <= metrics["val/chain"] <= 6.0
    with pytest.raises(UserError, match="fuse_layers"):  # going on training it needs its own layers
        build_eagle(tiny_backbone, None, init=str(path), fuse_layers=None)


def test_a_fused_draft_refuses_data_without_its_layers(fused, untapped):
    """A fused draft handed the last states alone would read them as predicted features and never
    train its fusion: refused, naming the key."""
    from pipeline.train import train
    _, _, _, data = fused
    cfg = compose_config([*TRAIN, "data.fuse_layers=null", "trainer.max_steps=1", f"data.root={data}"],
                         config_name="train", output_dir=data.parent / "unfused_data")
    with pytest.raises(ValueError, match="data.fuse_layers"):
        train(cfg)


def test_fused_cached_step_equals_the_training_forward(fused, tiny_backbone):
    """The decoding path reads [taps | last] for committed rows and its own predictions deeper,
    as the training forward and its unrolled depths do."""
    path, _, _, _ = fused
    draft = EagleDraft.load(path, tiny_backbone)
    dim = tiny_backbone.model.args.dim
    feats, toks = torch.randn(1, 7, 4 * dim), torch.randint(0, 1000, (1, 7))
    with torch.no_grad():
        ref = draft(feats, toks)[0]
        deep = draft.unrolled(feats, toks, 2)[1][0]
    a = draft.args
    kv = ContiguousKV(None, 16, 1, a.n_kv_heads, a.head_dim, torch.float32)
    seq = kv.create()
    out = []
    for lo, hi in ((0, 4), (4, 7)):
        out.append(forward_step(draft, kv, StepBatch.build([seq], [toks[0, lo:hi]], [None], [None], [kv.used(seq)]),
                                feats[0, lo:hi]))
        kv.commit(seq)
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # depth 2 of the chain from 3: the true pairs up to 3, then its own prediction
        f = torch.cat((draft.features(feats[:, :4]), ref[None, 3:4]), dim=1)
        torch.testing.assert_close(draft(f, toks[:, :5])[0, -1], deep[4], atol=1e-5, rtol=1e-5)


def _decode(tmp_path, checkpoint, backbone, *extra):
    from pipeline.decode import decode
    cfg = compose_config(["decode=tree_eagle", "model=tiny", f"proposer.checkpoint={checkpoint}", "tree.width=3",
                          "tree.depth=4", "tree.max_nodes=10", "proposer.nodes=null", "max_new_tokens=32",
                          "stream=false", "verify_lossless=true", "chat=false", *extra],
                         output_dir=tmp_path, input=str(tmp_path / "in.jsonl"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "in.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "{p}"}}\n' for i, p in enumerate(PROMPTS)))
    return decode(cfg, backbone)


@pytest.mark.parametrize("batch,dtype", [(1, "float32"), (3, "float32"), (3, "q4")])
def test_tree_eagle_with_a_fused_draft_is_lossless(fused, untapped, tmp_path, batch, dtype):
    from components.model.load import tiny
    path, _, _, _ = fused
    backbone = untapped if dtype == "float32" else tiny(dtype=dtype)
    widths = set()
    observe = EagleProposer.observe

    def seen(self, seq, tokens, hidden):
        widths.add(hidden.shape[-1])
        return observe(self, seq, tokens, hidden)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleProposer, "observe", seen)
        metrics, objs = _decode(tmp_path, path, backbone, f"batch_size={batch}", f"model.dtype={dtype}")
    assert widths == {4 * backbone.model.args.dim}  # the engine hands every committed row's fused layers
    assert metrics["lossless"], [it.get("first_divergence") for it in objs["results"]["items"]]
    assert metrics["tree_steps"] > 0
    proposer = objs["engine"].proposer
    assert backbone.model.taps == (0, 1, 2) and not proposer.kv.sequences
    assert objs["results"]["summary"]["tree"]["draft_fuse_layers"] == [0, 1, 2]


def test_the_unfused_draft_is_unchanged_beside_a_tapping_backbone(fused, untapped, tmp_path):
    """An EAGLE-1/2 draft reads the last state of whatever the engine hands it: with the backbone
    keeping layers for another draft it drafts exactly the same trees; its checkpoint has no fusion."""
    from pipeline.train import train
    _, _, _, data = fused
    cfg = compose_config([*TRAIN, "heads.fuse_layers=null", "trainer.max_steps=2", f"data.root={data}"],
                         config_name="train", output_dir=tmp_path / "run")
    _, objs = train(cfg)
    plain_path = tmp_path / "run" / "heads.safetensors"
    assert not objs["heads"].fused and "fuse_layers" not in EagleDraft.load(plain_path, untapped).info
    assert not any(k.startswith("fuse") for k in objs["heads"].state_dict())
    runs = []
    for taps in ((), (0, 1, 2)):
        untapped.model.tap(taps)
        _, o = _decode(tmp_path / f"taps{len(taps)}", plain_path, untapped, "batch_size=2")
        runs.append([(it["token_ids"], it["accepted_lengths"]) for it in o["results"]["items"]])
    assert runs[0] == runs[1]


def test_a_second_draft_fusing_other_layers_is_refused(fused, untapped):
    path, _, _, _ = fused
    untapped.model.tap((1,))
    with pytest.raises(UserError, match="already keeps layers"):
        EagleProposer(untapped, functools.partial(ContiguousKV, max_len=64), str(path))
