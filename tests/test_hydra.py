"""Hydra heads (heads=hydra): shapes and the Medusa start, the teacher-forced loss, checkpoints and
their kind, the tree grown node by node (children read the parent's path), lossless tree_medusa
decoding with them, and the tiny training job."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from components.heads import checkpoint
from components.heads.hydra import HydraHeads, build_hydra
from components.heads.medusa import MedusaHeads, build_heads
from components.heads.module import HydraModule
from components.model.linear import Int4
from pipeline.build import build_engine, component
from pipeline.core import DecodeState
from pipeline.errors import UserError

from helpers import TINY_VARIANTS, assert_saved_state, compose_config

TRAIN = ["model=tiny", "heads=hydra", "data.max_samples=24", "data.max_new_tokens=12", "data.gen_batch_size=12",
         "heads.draft_vocab=null", "~logger"]


def fresh(backbone, **kw) -> HydraHeads:
    return build_hydra(backbone, torch.ones(backbone.model.args.vocab_size), draft_vocab=None, **kw)


def meta(backbone) -> dict:
    return {"vocab_size": backbone.model.args.vocab_size, "fingerprint": backbone.model.fingerprint()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny training job through the real entry point, a few steps."""
    from pipeline.train import train
    root = tmp_path_factory.mktemp("hydra")
    cfg = compose_config([*TRAIN, "trainer.max_steps=4", f"data.root={root / 'data'}"], config_name="train",
                         output_dir=root / "run")
    metrics, objs = train(cfg)
    return root / "run", metrics, objs


def test_shapes_and_the_medusa_start(tiny_backbone):
    """Zero path matrices: fresh Hydra heads are fresh Medusa heads, whatever the path."""
    dim = tiny_backbone.model.args.dim
    hydra, medusa = fresh(tiny_backbone), build_heads(tiny_backbone, torch.ones(tiny_backbone.model.args.vocab_size),
                                                      draft_vocab=None)
    h, path = torch.randn(5, dim), torch.randint(0, 1000, (5, 3))
    logits = hydra(h, path)
    assert logits.shape == (3, 5, tiny_backbone.model.args.vocab_size)
    torch.testing.assert_close(logits, medusa(h))
    ids, logp = hydra.expand(h, path[:, :2], 4)  # depth 2: head 2 on each node's path
    assert ids.shape == logp.shape == (5, 4) and (logp <= 0).all() and (logp.diff(dim=-1) <= 0).all()
    assert [p.weight.shape for p in hydra.paths] == [(dim, k * dim) for k in (1, 2, 3)]


def test_teacher_forced_windows_and_the_loss_decreases(tiny_backbone):
    heads = fresh(tiny_backbone, num_heads=2)
    module = HydraModule(heads, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    module.log = lambda *a, **k: None
    seen, forward = {}, heads.forward

    def spy(h, path):
        seen["path"] = path
        return forward(h, path)
    heads.forward = spy
    hidden = torch.randn(2, 4, tiny_backbone.model.args.dim)
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, -100, -100]])
    module.loss((hidden, tokens), "train")
    # rows: every answer position; head k reads y_{t+1} .. y_{t+k}, the answer's own tokens
    assert seen["path"].tolist() == [[10, 11], [11, 12], [12, 13], [13, 0], [20, 21], [21, 0]]
    heads.forward = forward
    # the same h everywhere: only the path tells the targets apart (a Medusa head could not learn it)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 500, (4, 16), generator=g)
    hidden = torch.randn(1, 1, tiny_backbone.model.args.dim).expand(4, 16, -1)
    opt = module.configure_optimizers()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = module.loss((hidden, toks), "train")
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_checkpoint_round_trip_and_kind(tiny_backbone, tmp_path):
    heads = fresh(tiny_backbone)
    for p in heads.paths:
        torch.nn.init.normal_(p.weight, std=0.02)
    path = heads.save(tmp_path / "heads.safetensors", meta(tiny_backbone))
    assert checkpoint.kind(path) == "hydra" and checkpoint.kind(tmp_path / "missing.safetensors") is None
    assert_saved_state(path, heads, HydraHeads.FORMAT.frozen)  # the embedding is read from the backbone, never stored
    loaded = HydraHeads.load(path, tiny_backbone)
    h, p = torch.randn(3, tiny_backbone.model.args.dim), torch.randint(0, 1000, (3, 3))
    torch.testing.assert_close(loaded(h, p), heads(h, p))
    with pytest.raises(UserError, match="Hydra heads checkpoint"):
        MedusaHeads.load(path, tiny_backbone)
    medusa = build_heads(tiny_backbone, torch.ones(tiny_backbone.model.args.vocab_size), draft_vocab=None)
    mpath = medusa.save(tmp_path / "medusa.safetensors", meta(tiny_backbone))
    assert checkpoint.kind(mpath) == "medusa"
    with pytest.raises(UserError, match="heads.init"):
        HydraHeads.load(mpath, tiny_backbone)


def test_init_from_medusa_heads_starts_as_them(tiny_backbone, tmp_path):
    medusa = build_heads(tiny_backbone, torch.ones(tiny_backbone.model.args.vocab_size), draft_vocab=64)
    for blocks in medusa.blocks:
        torch.nn.init.normal_(blocks[0].linear.weight, std=0.05)
    mpath = medusa.save(tmp_path / "medusa.safetensors", meta(tiny_backbone))
    hydra = build_hydra(tiny_backbone, None, init=str(mpath))
    assert torch.equal(hydra.vocab_ids, medusa.vocab_ids)
    h = torch.randn(4, tiny_backbone.model.args.dim)
    torch.testing.assert_close(hydra(h, torch.randint(0, 1000, (4, 3))), medusa(h))
    with pytest.raises(ValueError, match="num_heads"):
        build_hydra(tiny_backbone, None, num_heads=2, init=str(mpath))
    saved = hydra.save(tmp_path / "hydra.safetensors", meta(tiny_backbone))
    with safe_open(str(saved), "pt") as f:
        assert json.loads(f.metadata()["hydra"])["init"] == str(mpath)


class FakeHeads:
    """Sequential heads whose children are a function of the node's last token: child r of a node
    with token a is 10 a + r + 1, at log-probability -(r + 1) / depth."""
    sequential, num_heads, storage = True, 3, "float32"

    def __init__(self):
        self.calls = []

    def expand(self, h, path, k):
        self.calls.append(path.tolist())
        d = path.shape[1]
        r = torch.arange(k)
        return path[:, -1:] * 10 + r + 1, -(r + 1).float().expand(path.shape[0], k) / d


def test_tree_grows_node_by_node_from_each_path(trained, tiny_backbone):
    from components.proposer.medusa import MedusaProposer
    run, _, _ = trained
    prop = MedusaProposer(tiny_backbone, str(run / "heads.safetensors"), width=2, depth=3, max_nodes=6, nodes=None)
    prop.heads = FakeHeads()
    states = [DecodeState(seq=i, tokens=[5, root], hidden=torch.zeros(tiny_backbone.model.args.dim), model=None,
                          kv=None, budget=16) for i, root in enumerate((1, 2))]
    trees = prop.propose(states)
    # one call per depth, every node of both sequences in it; depth 1 from the roots
    assert prop.heads.calls[0] == [[1], [2]]
    assert prop.heads.calls[1] == [[1, 11], [1, 12], [2, 21], [2, 22]]
    assert len(prop.heads.calls) == 3
    tree = trees[0]
    paths = {tuple(tree.tokens[i].item() for i in tree.path_to(n)[1:]) for n in range(1, tree.size)}
    # depth 3 expands the best 2 of depth 2 (111 at -1.5, 112 at -2; not 121 at -2.5), and the best 6
    # by cumulative log-probability: 11 (-1), 111 (-1.5), 1111 (-1.83), 12 (-2), 112 (-2), 1112 (-2.17)
    assert prop.heads.calls[2][:2] == [[1, 11, 111], [1, 11, 112]]
    assert paths == {(11,), (11, 111), (11, 111, 1111), (12,), (11, 112), (11, 111, 1112)}
    assert trees[1].tokens[1:].tolist() != tree.tokens[1:].tolist()  # the children read their own paths
    scored = dict(prop.scored(states)[0])
    assert scored[(11, 111)] == pytest.approx(torch.tensor(-1.5).exp().item())


def lossless_engines(backbone, checkpoint_path, batch, *extra):
    common = ["model=tiny", "max_new_tokens=32", f"batch_size={batch}"]
    plain, _ = build_engine(compose_config(["decode=greedy", *common]), backbone)
    spec, _ = build_engine(compose_config(["decode=tree_medusa", *common, f"proposer.checkpoint={checkpoint_path}",
                                           *extra]), backbone)
    return plain, spec


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_with_hydra_heads_is_plain_greedy(trained, tiny_backbone, tmp_path, batch):
    """The trained heads on the tied tiny model (its drafts are accepted), and heads with random path
    matrices on the untied one (its greedy walk rejects most drafts), the tree sized by nodes=auto."""
    run, _, _ = trained
    untied = component(compose_config(list(TINY_VARIANTS["untied"])).model)
    rnd = fresh(untied)
    for p in rnd.paths:
        torch.nn.init.normal_(p.weight, std=0.5)
    rnd_path = rnd.save(tmp_path / "random.safetensors", meta(untied))
    prompts = [tiny_backbone.tokenizer.encode(t) for t in ("hello there", "one two three four", "a")]
    for bb, ckpt in ((tiny_backbone, run / "heads.safetensors"), (untied, rnd_path)):
        plain, spec = lossless_engines(bb, ckpt, batch, "proposer.nodes=null")
        ref, gens = plain.run(prompts), spec.run(prompts)
        assert [g.token_ids for g in gens] == [r.token_ids for r in ref]
        assert max(d for g in gens for d in g.tree_depths) == 3  # it drafted, three deep


def test_q4_decoding_quantizes_the_heads_and_stays_lossless(trained, tmp_path):
    from components.model.load import tiny
    from pipeline.decode import decode
    run, _, _ = trained
    cfg = compose_config(["decode=tree_medusa", "model=tiny", "model.dtype=q4", f"proposer.checkpoint={run / 'heads.safetensors'}",
                          "prompt=hello there", "max_new_tokens=32", "stream=false", "verify_lossless=true"],
                         output_dir=tmp_path)
    metrics, objs = decode(cfg, tiny(dtype="q4"))
    tree = objs["results"]["summary"]["tree"]
    assert metrics["lossless"] and tree["sequential"] and tree["draft_storage"] == "q4" and tree["nodes"] == "auto"
    assert all(isinstance(p, Int4) for p in objs["engine"].drafter.heads.paths)


def test_tree_choices_are_refused(trained, tiny_backbone):
    from components.proposer.medusa import MedusaProposer
    run, _, _ = trained
    with pytest.raises(UserError, match="grow their tree"):
        MedusaProposer(tiny_backbone, str(run / "heads.safetensors"), choices=[[0], [0, 0]])


def test_training_job_writes_hydra_heads(trained):
    run, metrics, objs = trained
    assert metrics["steps"] == 4 and (run / "checkpoints" / "last.ckpt").is_file()
    assert checkpoint.kind(run / "heads.safetensors") == "hydra"
    assert_saved_state(run / "heads.safetensors", objs["heads"], HydraHeads.FORMAT.frozen)
    for k in (1, 2, 3):
        assert {f"val/head{k}_top1", f"val/head{k}_top5", f"val/head{k}_loss"} <= set(metrics)
    assert json.loads((run / "metrics.json").read_text()) == metrics


def test_hybrid_ranks_hydra_candidates(trained, tiny_backbone, tmp_path):
    """proposer=hybrid reads the sequential heads' scored candidates as it reads Medusa's."""
    from pipeline.decode import decode
    run, _, _ = trained
    cfg = compose_config(["decode=tree_hybrid", "model=tiny", "proposer.sources=[medusa,suffix]",
                          f"proposer.medusa.checkpoint={run / 'heads.safetensors'}", "prompt=hello there",
                          "max_new_tokens=32", "stream=false", "verify_lossless=true"], output_dir=tmp_path)
    metrics, objs = decode(cfg, tiny_backbone)
    assert metrics["lossless"] and objs["results"]["summary"]["tree"]["sources"]["medusa"]["sequential"]
