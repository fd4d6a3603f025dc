"""Medusa heads: the offset convention, the loss, the training job (checkpoints, resume, wandb,
DDP), checkpoint refusal, lossless tree_medusa decoding, and the export layouts."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from components.data.datamodule import head_targets
from components.data.self_distill import DistillSet, generate_batch
from components.heads.medusa import FORMAT as MEDUSA
from components.heads.medusa import MedusaHeads, build_heads, select_draft_vocab
from components.heads.module import MedusaModule, head_weights
from pipeline.core import Proposer
from pipeline.errors import UserError

from helpers import PYTHON, REPO_ROOT, assert_saved_state, compose_config, decoder_for, rebuild

TRAIN = ["model=tiny", "data.max_samples=24", "data.max_new_tokens=12", "data.gen_batch_size=12",
         "data.batch_size=32", "heads.draft_vocab=null", "~logger"]


def test_head_targets_follow_the_offset_convention():
    # two answers: [10, 11, 12, 13] and [20, 21]
    ds = DistillSet(torch.tensor([10, 11, 12, 13, 20, 21]), torch.zeros(6, 4), torch.tensor([0, 4, 6]))
    t = head_targets(ds, 2)
    # hidden[i] predicts tokens[i] (backbone head, t+1); head k predicts tokens[i + k] (t+1+k)
    assert t[:, 0].tolist() == [11, 12, 13, -100, 21, -100]
    assert t[:, 1].tolist() == [12, 13, -100, -100, -100, -100]


def test_loss_weights():
    assert head_weights(3, 0.8) == pytest.approx([0.8, 0.64, 0.512])
    assert head_weights(2, weights=[1.0, 0.5]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="loss.weights"):
        head_weights(3, weights=[1.0])
    with pytest.raises(ValueError, match="decay"):
        head_weights(3, decay=0.0)


def test_fresh_heads_are_the_backbone_head(tiny_backbone):
    """Zero-initialised ResBlocks are the identity: every head starts as the backbone's LM head."""
    m = tiny_backbone.model
    counts = torch.ones(m.args.vocab_size)
    heads = build_heads(tiny_backbone, counts, num_heads=2, draft_vocab=None)
    h = torch.randn(5, m.args.dim)
    torch.testing.assert_close(heads(h)[1], m.logits(h), atol=1e-4, rtol=1e-4)
    copy = build_heads(tiny_backbone, counts, num_heads=2, lm_head="copy", draft_vocab=None)
    assert sum(p.numel() for p in copy.parameters() if p.requires_grad) > sum(p.numel() for p in heads.parameters())


def test_draft_vocab_keeps_eos_and_the_most_frequent():
    counts = torch.tensor([5, 0, 9, 1, 7, 0, 3, 2, 8, 4, 6, 0])
    ids = select_draft_vocab(counts, 8, always=[11])
    assert 11 in ids.tolist() and 2 in ids.tolist() and 1 not in ids.tolist()
    assert ids.tolist() == sorted(ids.tolist())


def test_loss_is_weighted_cross_entropy_over_valid_targets(tiny_backbone):
    heads = build_heads(tiny_backbone, torch.ones(tiny_backbone.model.args.vocab_size), num_heads=2, draft_vocab=None)
    module = MedusaModule(heads, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), decay=0.5)
    module.log = lambda *a, **k: None
    h = torch.randn(4, tiny_backbone.model.args.dim)
    y = torch.tensor([[1, 2], [3, -100], [5, 6], [7, -100]])
    logits = heads(h)
    ref = 0.5 * torch.nn.functional.cross_entropy(logits[0], y[:, 0]) \
        + 0.25 * torch.nn.functional.cross_entropy(logits[1], y[:, 1], ignore_index=-100)
    torch.testing.assert_close(module.loss((h, y), "train"), ref)


def test_batched_generation_matches_plain_greedy(tiny_backbone):
    """The data job's generator (the core engine, continuous batching) gives the cache-free greedy
    answer of every prompt, and the hidden state that predicted each of its tokens."""
    tok, model = tiny_backbone.tokenizer, tiny_backbone.model
    prompts = [tok.encode(t) for t in ["a b c", "the quick brown fox jumps", "hello", "one two"]]
    out = generate_batch(tiny_backbone, prompts, 10, batch_size=3)
    for p, (toks, hidden) in zip(prompts, out):
        seq = list(p)
        with torch.inference_mode():
            for t in toks:
                h = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
                assert int(model.logits(h).argmax()) == t
                seq.append(t)
            ref = model(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None])[0, len(p) - 1:]
        torch.testing.assert_close(hidden.float(), ref.to(torch.bfloat16).float())


def test_data_grows_in_parts_and_reads_prefixes(tiny_backbone, tmp_path, monkeypatch):
    """A larger request generates only the missing answers; a smaller one reads a prefix of the same
    set; an interrupted job resumes from its last part; the held-out answers of a prefix are the
    prefix's share of the larger set's."""
    import components.data.self_distill as sd
    calls = []
    real = sd.generate_batch
    monkeypatch.setattr(sd, "generate_batch", lambda bb, ps, *a, **k: calls.append(len(ps)) or real(bb, ps, *a, **k))
    kw = dict(max_new_tokens=6, batch_size=4, save_every=1, root=str(tmp_path))
    small = sd.build_self_distill(tiny_backbone, max_samples=6, **kw)
    assert calls == [4, 2] and small.samples == 6
    out = next(tmp_path.glob("self_distill-*"))
    assert sorted(p.name for p in out.glob("part-*")) == ["part-000000-000004.safetensors", "part-000004-000006.safetensors"]
    calls.clear()
    big = sd.build_self_distill(tiny_backbone, max_samples=11, **kw)
    assert calls == [4, 1] and big.samples == 11  # answers 6..10 only
    assert json.loads((out / "manifest.json").read_text()) == {"answers": 11, "tokens": int(big.offsets[-1])}
    prefix = sd.build_self_distill(tiny_backbone, max_samples=5, **kw)
    assert calls == [4, 1] and prefix.samples == 5
    torch.testing.assert_close(prefix.tokens, big.tokens[:int(big.offsets[5])])
    torch.testing.assert_close(prefix.hidden, big.hidden[:int(big.offsets[5])])
    (out / "part-000010-000011.safetensors").unlink()  # interrupted before its last part
    calls.clear()
    again = sd.build_self_distill(tiny_backbone, max_samples=11, **kw)
    assert calls == [1] and torch.equal(again.tokens, big.tokens)
    head = sd.build_self_distill(tiny_backbone, max_samples=3, **kw)  # inside the first part
    assert head.samples == 3 and torch.equal(head.tokens, big.tokens[:int(big.offsets[3])])
    calls.clear()
    wider = sd.build_self_distill(tiny_backbone, **{**kw, "batch_size": 3, "save_every": 2}, max_samples=14)
    assert calls == [3] and torch.equal(wider.tokens[:big.tokens.numel()], big.tokens)  # parts of another size continue
    train_big, val_big = big.split(0.3)
    train_prefix, val_prefix = prefix.split(0.3)
    assert torch.equal(val_prefix.tokens, val_big.tokens[:val_prefix.tokens.numel()])
    assert torch.equal(train_prefix.tokens, train_big.tokens[:train_prefix.tokens.numel()])
    assert big.split(0.3, seed=1)[1].offsets.diff().tolist() != val_big.offsets.diff().tolist()  # the seed matters
    (out / "part-000004-000006.safetensors").unlink()  # a gap: an error, never a silent shortfall
    with pytest.raises(UserError, match="does not continue"):
        sd._first(out, 11)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A seconds-long training run on the tiny model, through the real entry point."""
    from pipeline.train import train
    root = tmp_path_factory.mktemp("train")
    cfg = compose_config([*TRAIN, "trainer.max_steps=6", f"data.root={root / 'data'}"], config_name="train",
                         output_dir=root / "run")
    metrics, objs = train(cfg)
    return root, metrics, objs


def test_training_writes_checkpoints_metrics_and_heads(trained):
    root, metrics, objs = trained
    run = root / "run"
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == metrics["steps"] == 6
    assert_saved_state(run / "heads.safetensors", objs["heads"], MEDUSA.frozen)
    assert json.loads((run / "metrics.json").read_text()) == metrics
    for k in (1, 2, 3):
        assert f"val/head{k}_top1" in metrics and f"val/head{k}_top5" in metrics and f"val/head{k}_loss" in metrics
    csv = next((run / "csv").rglob("metrics.csv")).read_text()
    assert "train/head1_loss" in csv.splitlines()[0]
    data = next((root / "data").glob("self_distill-*"))
    assert json.loads((data / "config.json").read_text())["max_new_tokens"] == 12  # TRAIN's data.max_new_tokens
    assert json.loads((data / "manifest.json").read_text())["answers"] == 24
    assert [p.name for p in data.glob("part-*")] == ["part-000000-000024.safetensors"]


def test_training_resumes_from_last_checkpoint(trained):
    from pipeline.train import train
    root, _, _ = trained
    cfg = compose_config([*TRAIN, "trainer.max_steps=9", f"data.root={root / 'data'}"], config_name="train",
                         output_dir=root / "run")
    metrics, _ = train(cfg)
    assert metrics["steps"] == 9  # 6 restored + 3 new


def test_wandb_logs_offline_into_the_run_dir(tmp_path, trained):
    from pipeline.train import train
    root, _, _ = trained
    cfg = compose_config([*[o for o in TRAIN if o != "~logger"], "trainer.max_steps=2",
                          f"data.root={root / 'data'}"], config_name="train", output_dir=tmp_path)
    train(cfg)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_checkpoint_refusals(trained, tmp_path):
    from components.model.load import tiny
    root, _, _ = trained
    ckpt = root / "run" / "heads.safetensors"
    with pytest.raises(UserError, match="hidden size"):
        MedusaHeads.load(ckpt, tiny(dim=32, n_heads=2, n_kv_heads=1))
    with pytest.raises(UserError, match="another backbone"):
        MedusaHeads.load(ckpt, tiny(seed=1))
    pickled = tmp_path / "heads.pt"
    torch.save({"x": torch.zeros(1)}, pickled)
    with pytest.raises(UserError, match="safetensors"):
        MedusaHeads.load(pickled, tiny())
    with pytest.raises(UserError, match="does not exist"):
        MedusaHeads.load(tmp_path / "missing.safetensors", tiny())


@pytest.mark.parametrize("dtype", ["float32", "q4"])
def test_tree_medusa_is_lossless(trained, tiny_backbone, tmp_path, dtype):
    """Beside a q4 backbone the heads' projection runs in 4 bits (only the drafts can change)."""
    from components.model.load import tiny
    from pipeline.decode import decode
    root, _, _ = trained
    cfg = compose_config(["decode=tree_medusa", "model=tiny", f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}",
                          "proposer.tree_file=null", "tree.width=2", "tree.depth=3", "tree.max_nodes=8",
                          "prompt=hello there", "max_new_tokens=40", "stream=false", "verify_lossless=true",
                          f"model.dtype={dtype}"], output_dir=tmp_path)
    metrics, objs = decode(cfg, tiny_backbone if dtype == "float32" else tiny(dtype=dtype))
    assert metrics["lossless"], objs["results"]["items"][0]
    assert metrics["steps"] < 40  # the heads did draft something
    assert objs["results"]["summary"]["tree"]["draft_storage"] == ("q4" if dtype == "q4" else "float32")


def test_tree_search_writes_a_valid_tree(trained, tmp_path):
    from pipeline.tree_search import search
    root, _, _ = trained
    cfg = compose_config(["model=tiny", f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}",
                          "data.max_samples=24", "data.max_new_tokens=12", f"data.root={root / 'data'}",
                          "search.max_nodes=6", "search.max_rank=3", "search.repeats=1"],
                         config_name="tree_search", output_dir=tmp_path)
    result, _ = search(cfg)
    tree = json.loads((tmp_path / "tree.json").read_text())
    assert tree["choices"] == result["choices"] and 0 <= len(tree["choices"]) <= 6
    from pipeline.core import StaticTree
    if tree["choices"]:
        StaticTree.from_choices(tree["choices"])  # every path's parent is in the tree
    rows = tree["table"]
    assert rows[0]["nodes"] == 0 and rows[0]["expected_speedup"] == 1.0  # plain decoding is a candidate
    assert all(b["expected_accept_length"] >= a["expected_accept_length"] for a, b in zip(rows, rows[1:]))
    best = max(rows, key=lambda r: r["expected_speedup"])
    assert tree["nodes"] == (best["nodes"] if best["expected_speedup"] >= 1.05 else 0)  # search.min_gain


def test_policy_picks_the_best_size_and_plain_when_no_tree_pays():
    from components.proposer.policy import choose
    order = [((0,), 0.6), ((0, 0), 0.4), ((1,), 0.1), ((0, 0, 0), 0.05)]
    cheap = {0: 10.0, 1: 11.0, 2: 12.0, 4: 14.0}  # ms per step with n drafts
    best = choose(order, cheap)
    assert best["nodes"] == 2 and best["choices"] == [[0], [0, 0]]
    assert abs(best["expected_speedup"] - 2.0 / 12.0 * 10.0) < 1e-9
    dear = {0: 10.0, 1: 20.0, 4: 40.0}  # a tree costs more than it returns
    best = choose(order, dear)
    assert best["nodes"] == 0 and best["choices"] == [] and best["expected_speedup"] == 1.0


def tree_file_with(tmp_path, p: float):
    """A tree-search result whose paths are accepted with probability p each."""
    order = [[[0], p], [[0, 0], p * p], [[1], p / 2]]
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"choices": [o[0] for o in order], "path_probability": order}))
    return path


def test_no_tree_pays_decodes_plainly_and_says_so(trained, tiny_backbone, tmp_path, capsys):
    from pipeline.decode import decode
    root, _, _ = trained
    cfg = compose_config(["decode=tree_medusa", "model=tiny", f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}",
                          f"proposer.tree_file={tree_file_with(tmp_path, 1e-4)}", "prompt=hello there",
                          "max_new_tokens=12", "stream=false"], output_dir=tmp_path)
    metrics, objs = decode(cfg, tiny_backbone)
    assert "no draft tree pays" in capsys.readouterr().err
    spec = objs["results"]["summary"]["speculation"]
    assert spec["active"] is False and spec["nodes"] == 0
    item = objs["results"]["items"][0]
    assert item["accepted_lengths"] == [1] * len(item["accepted_lengths"])


class CountsDrafts(Proposer):
    """Another proposer's drafts, unchanged, with the number of drafted nodes of each proposal."""

    def __init__(self, inner: Proposer):
        self.inner, self.nodes = inner, []
        self.sampled = inner.sampled

    @property
    def active(self) -> bool:
        return self.inner.active

    def start(self, seq, prompt_ids):
        self.inner.start(seq, prompt_ids)

    def propose(self, states):
        trees = self.inner.propose(states)
        self.nodes += [0 if t is None else t.size - 1 for t in trees]
        return trees

    def describe(self):
        return self.inner.describe()

    def observe(self, seq, tokens, hidden):
        self.inner.observe(seq, tokens, hidden)

    def release(self, seq):
        self.inner.release(seq)


def test_p_min_drops_unlikely_drafts_and_stays_lossless(trained, tiny_backbone, tmp_path):
    root, _, _ = trained
    ckpt = f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}"
    prompts = [tiny_backbone.tokenizer.encode(t, add_special_tokens=False) for t in ["hello there", "a b a b a"]]
    ref = [g.token_ids for g in decoder_for("greedy", tiny_backbone, max_new_tokens=24).run(prompts)]
    sizes = {}
    for p_min in (0.0, 0.3, 0.9999):
        eng = decoder_for("tree_medusa", tiny_backbone, ckpt, "proposer.tree_file=null", "tree.width=2",
                          "tree.depth=3", "tree.max_nodes=8", f"proposer.p_min={p_min}", max_new_tokens=24)
        counted = CountsDrafts(eng.drafter)
        assert [g.token_ids for g in rebuild(eng, proposer=counted).run(prompts)] == ref
        assert counted.nodes, "the proposer was never asked for a draft"
        sizes[p_min] = sum(counted.nodes)
    assert sizes[0.0] > sizes[0.3] >= sizes[0.9999] == 0


def test_export_finds_the_backbone_the_heads_were_trained_on(trained, tmp_path):
    """Heads trained on model=tiny export with no backbone given: train_config.yaml names it."""
    from pipeline.export import export
    root, _, objs = trained
    out = export(str(root / "run" / "heads.safetensors"), str(tmp_path / "out"))
    t, D = load_file(out / "medusa_lm_head.safetensors"), objs["heads"].dim
    assert t["0.0.linear.weight"].shape == (D, D) and t["2.1.weight"].shape[1] == D


@pytest.mark.parametrize("fmt", ["medusa", "vllm"])
def test_export_layouts(trained, tiny_backbone, tmp_path, fmt):
    from pipeline.export import export
    root, _, _ = trained
    out = export(str(root / "run" / "heads.safetensors"), str(tmp_path), fmt, backbone=tiny_backbone)
    cfg = json.loads((out / "config.json").read_text())
    V, D = tiny_backbone.model.args.vocab_size, tiny_backbone.model.args.dim
    if fmt == "medusa":
        t = load_file(out / "medusa_lm_head.safetensors")
        assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
        assert t["0.0.linear.weight"].shape == (D, D) and t["2.1.weight"].shape == (V, D)
    else:
        t = load_file(out / "model.safetensors")
        assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3
        assert t["blocks.1.layers.0.bias"].shape == (D,) and t["lm_heads.2.weight"].shape == (V, D)


def test_ddp_two_processes_on_cpu(tmp_path):
    """The same job under Lightning's DDP strategy: 2 processes, gloo, a few steps."""
    run = tmp_path / "run"
    r = subprocess.run([PYTHON, "-m", "pipeline.train", *TRAIN, "trainer.max_steps=3", "trainer.strategy=ddp",
                        "trainer.devices=2", f"data.root={tmp_path / 'data'}", f"hydra.run.dir={run}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with safe_open(str(run / "heads.safetensors"), "pt") as f:
        header = json.loads(f.metadata()[MEDUSA.key])
    assert header["format"] == MEDUSA.name and header["metrics"]["steps"] == 3
    assert json.loads((run / "metrics.json").read_text())["steps"] == 3


def test_dynamic_tree_is_best_first():
    from pipeline.core import dynamic_tree
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    logp = torch.log(torch.tensor([[0.6, 0.3], [0.9, 0.05], [0.5, 0.4]]))
    tree = dynamic_tree(7, ids, logp, width=2, max_nodes=4)
    # best paths: [10] .6, [10,20] .54, [11] .3, [10,20,30] .27
    assert tree.tokens.tolist() == [7, 10, 20, 11, 30]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 2]
    assert tree.depth.tolist() == [0, 1, 2, 1, 3]


def test_dynamic_medusa_tree_is_lossless(trained, tiny_backbone, tmp_path):
    from pipeline.decode import decode
    root, _, _ = trained
    cfg = compose_config(["decode=tree_medusa", "model=tiny", f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}",
                          "proposer.dynamic=true", "tree.width=3", "tree.max_nodes=10", "prompt=good morning",
                          "max_new_tokens=40", "stream=false", "verify_lossless=true"], output_dir=tmp_path)
    metrics, objs = decode(cfg, tiny_backbone)
    nodes = [n for it in objs["results"]["items"] for n in it["step_nodes"] if n > 1]
    assert metrics["lossless"] and max(nodes) == 11  # 10 drafts + the root (smaller only near the end)
    assert all(n == 11 for n in nodes[:-3])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dynamic", [False, True])
def test_medusa_near_the_context_end_equals_greedy(trained, batch, dynamic):
    """A deep Medusa tree is never larger than the tokens left: up to the context end (48 tokens),
    at any batch size, the tokens are plain greedy's and the requests stop with "context"."""
    from pipeline.build import build_engine, component
    root, _, _ = trained
    bb = component(compose_config(["model=tiny", "model.max_seq_len=48"]).model)
    text = bb.tokenizer.encode("The cat sat on the mat and looked at the door. " * 6, add_special_tokens=False)
    prompts = [text[:n] for n in (20, 35, 44, 46)]
    common = ["model=tiny", "max_new_tokens=64", f"batch_size={batch}"]
    plain, _ = build_engine(compose_config(["decode=greedy", *common]), bb)
    spec, _ = build_engine(compose_config(["decode=tree_medusa", *common, "proposer.tree_file=null",
                                           f"proposer.checkpoint={root / 'run' / 'heads.safetensors'}",
                                           "tree.width=3", "tree.depth=3", "tree.max_nodes=12",
                                           f"proposer.dynamic={str(dynamic).lower()}"]), bb)
    ref, gens = plain.run(prompts), spec.run(prompts)
    for p, r, g in zip(prompts, ref, gens):
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason == "context"
        for j, depth in enumerate(g.tree_depths):
            assert depth <= 48 - len(p) - sum(g.accepted_lengths[:j + 1]) - 1
    assert sum(g.steps for g in gens) < sum(len(g.token_ids) for g in gens), "the heads never drafted"


def test_decoding_stacks_the_heads_into_one_product():
    """decode_features (one (K dim, dim) product a step) computes the heads' features as `features`
    does, to float32 rounding; training and Hydra heads keep the per-head path."""
    from components.heads.medusa import MedusaHeads
    m = MedusaHeads(64, 3, 1, "shared", torch.arange(10), torch.randn(10, 64)).eval()
    for blk in m.blocks:
        torch.nn.init.normal_(blk[0].linear.weight, std=0.1)
        torch.nn.init.normal_(blk[0].linear.bias, std=0.1)
    h = torch.randn(5, 64)
    assert torch.allclose(m.decode_features(h), m.features(h), atol=1e-5)
    assert m.decode_features(h).shape == (3, 5, 64)
    m.train()
    assert torch.equal(m.decode_features(h), m.features(h))
