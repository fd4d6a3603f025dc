"""EAGLE drafts: training through `python -m pipeline.train heads=eagle` on the tiny model, strict
checkpoints, the cached draft step equal to its training forward, best-first dynamic trees, and
tree_eagle lossless against greedy (batched too) with no draft-cache leak."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from components.heads.eagle import FORMAT as EAGLE
from components.heads.eagle import EagleDraft, build_eagle
from components.kv.contiguous import ContiguousKV
from components.proposer.eagle import EagleProposer, _Growing
from pipeline.core import StepBatch, forward_step
from pipeline.errors import UserError

from helpers import REPO_ROOT, assert_saved_state, compose_config

TRAIN = ["model=tiny", "heads=eagle", "data.max_samples=24", "data.max_new_tokens=16", "data.gen_batch_size=12",
         "data.answers_per_batch=4", "heads.draft_vocab=null", "~logger"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from pipeline.train import train
    root = tmp_path_factory.mktemp("eagle")
    cfg = compose_config([*TRAIN, "trainer.max_steps=8", f"data.root={root / 'data'}"], config_name="train",
                         output_dir=root / "run")
    metrics, objs = train(cfg)
    return root / "run" / "heads.safetensors", metrics, objs


def test_training_writes_a_draft_and_its_metrics(trained):
    path, metrics, objs = trained
    assert isinstance(objs["heads"], EagleDraft)
    assert_saved_state(path, objs["heads"], EAGLE.frozen, torch.bfloat16)  # stored in bfloat16
    for k in ("val/feature_loss", "val/ce", "val/head1_top1", "val/head1_top5", "val/loss"):
        assert k in metrics
    assert metrics["steps"] == 8 and metrics["train_tokens"] > 0


def test_checkpoints_load_strictly(trained, tiny_backbone, tmp_path):
    from safetensors.torch import load_file, save_file
    from components.model.load import tiny
    path, _, _ = trained
    draft = EagleDraft.load(path, tiny_backbone)
    assert not draft.training
    tensors = load_file(str(path))
    with open(path, "rb") as f:  # the same header, one tensor missing
        import json
        import struct
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))["__metadata__"]
    broken = tmp_path / "broken.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "block.w2.weight"}, str(broken), metadata=meta)
    with pytest.raises(UserError, match="block.w2.weight"):
        EagleDraft.load(broken, tiny_backbone)
    with pytest.raises(UserError, match="another backbone"):
        EagleDraft.load(path, tiny(seed=1))
    with pytest.raises(UserError, match="hidden size"):
        EagleDraft.load(path, tiny(dim=32, n_heads=2, n_kv_heads=1))
    with pytest.raises(UserError, match="does not exist"):
        EagleDraft.load(tmp_path / "none.safetensors", tiny_backbone)


def test_medusa_checkpoint_is_refused_as_a_draft(tiny_backbone, tmp_path):
    from components.heads.medusa import build_heads
    bb = tiny_backbone
    heads = build_heads(bb, torch.ones(bb.model.args.vocab_size, dtype=torch.long), draft_vocab=None)
    path = heads.save(tmp_path / "heads.safetensors", {"vocab_size": bb.model.args.vocab_size})
    with pytest.raises(UserError, match="Medusa head checkpoint"):
        EagleDraft.load(path, bb)


def test_cached_step_equals_the_training_forward(tiny_backbone):
    """The decoding path (own KV pool, packed rows, two calls) gives the training forward's features."""
    torch.manual_seed(0)
    bb = tiny_backbone
    draft = build_eagle(bb, torch.ones(bb.model.args.vocab_size, dtype=torch.long), draft_vocab=None).eval()
    feats, toks = torch.randn(1, 7, bb.model.args.dim), torch.randint(0, 1000, (1, 7))
    with torch.no_grad():
        ref = draft(feats, toks)[0]
    a = draft.args
    kv = ContiguousKV(None, 16, 1, a.n_kv_heads, a.head_dim, torch.float32)
    seq = kv.create()
    outs = []
    for lo, hi in ((0, 4), (4, 7)):
        batch = StepBatch.build([seq], [toks[0, lo:hi]], [None], [None], [kv.used(seq)])
        outs.append(forward_step(draft, kv, batch, feats[0, lo:hi]))
        kv.commit(seq)
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-5, rtol=1e-5)


def test_unrolled_training_sees_what_a_drafted_chain_sees(tiny_backbone):
    """The training-time test (EagleDraft.unrolled) at depth j from chain start i equals the forward over
    the true pairs up to i followed by the draft's own predictions: the cache a depth-j draft reads
    (and the forward equals the cached step: the test above)."""
    torch.manual_seed(0)
    bb = tiny_backbone
    draft = build_eagle(bb, torch.ones(bb.model.args.vocab_size, dtype=torch.long), draft_vocab=None).eval()
    T, D = 9, 4
    feats, toks = torch.randn(2, T, bb.model.args.dim), torch.randint(0, 1000, (2, T))
    with torch.no_grad():
        preds = draft.unrolled(feats, toks, D)
        torch.testing.assert_close(preds[0], draft(feats, toks), atol=1e-5, rtol=1e-5)
        for i in (0, 3, T - D):
            f = feats[:, :i + 1]
            for j in range(D):
                ref = draft(f, toks[:, :i + j + 1])[:, -1]  # depth j of the chain from i
                torch.testing.assert_close(preds[j][:, i + j], ref, atol=1e-5, rtol=1e-5)
                f = torch.cat((f, ref[:, None]), dim=1)


def test_training_time_test_trains_from_a_draft(trained, tmp_path):
    """heads.init=<draft> goes on training it (its vocabulary kept) with module.unroll; validation
    reports each depth's top-1 and the greedy chain's accepted length."""
    from pipeline.train import train
    path, _, objs = trained
    cfg = compose_config([*TRAIN, "trainer.max_steps=2", f"heads.init={path}", "module.unroll=3", "module.eval_depth=4",
                          f"data.root={path.parent.parent / 'data'}"], config_name="train", output_dir=tmp_path / "run")
    metrics, new = train(cfg)
    assert torch.equal(new["heads"].vocab_ids, objs["heads"].vocab_ids)
    assert {f"val/depth{j}_top1" for j in (1, 2, 3, 4)} <= set(metrics)
    assert 1.0 <= metrics["val/chain"] <= 5.0
    assert metrics["val/depth1_top1"] == pytest.approx(metrics["val/head1_top1"])
    with pytest.raises(UserError, match="heads.init"):
        train(compose_config([*TRAIN, "heads.init=elsewhere"], config_name="train", output_dir=tmp_path / "bad"))


def test_dynamic_tree_keeps_the_best_candidates_as_a_tree():
    g = _Growing(depth=3)
    g.add_children(0, torch.log(torch.tensor([0.6, 0.3, 0.1])), 3, torch.tensor([10, 11, 12]), torch.zeros(2))
    g.add_children(1, torch.log(torch.tensor([0.9, 0.1, 0.0])), 2, torch.tensor([20, 21, 22]), torch.zeros(2))
    tree = g.tree(root=5, max_nodes=3, floor=-1e9)  # scores: 10:.6, 20:.54, 11:.3, 21:.06, 12:.1
    assert tree.tokens.tolist() == [5, 10, 11, 20] and tree.parents.tolist() == [-1, 0, 0, 1]
    assert g.tree(root=5, max_nodes=8, floor=torch.log(torch.tensor(0.5)).item()).tokens.tolist() == [5, 10, 20]


@pytest.mark.parametrize("batch,dtype,kv", [(1, "float32", "contiguous"), (3, "float32", "contiguous"),
                                            (3, "float32", "paged"), (3, "q4", "contiguous")])
def test_tree_eagle_is_lossless_and_frees_its_cache(trained, tiny_backbone, tmp_path, batch, dtype, kv):
    """The draft's own cache is a manager of the run's kv group."""
    """Beside a q4 backbone the draft itself runs in 4 bits (only which tokens are proposed changes)."""
    from components.model.linear import Int4
    from components.model.load import tiny
    from pipeline.decode import decode
    path, _, _ = trained
    cfg = compose_config(["decode=tree_eagle", "model=tiny", f"proposer.checkpoint={path}", "tree.width=3",
                          "tree.depth=4", "tree.max_nodes=10", "proposer.nodes=null", "max_new_tokens=32", "stream=false",
                          f"batch_size={batch}", "verify_lossless=true", "chat=false", f"model.dtype={dtype}", f"kv={kv}"],
                         output_dir=tmp_path, input=str(tmp_path / "in.jsonl"))
    prompts = ["one two three one two three", "hello there", "the cat sat on the mat, the cat", "a b a b a b"]
    (tmp_path / "in.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "{p}"}}\n' for i, p in enumerate(prompts)))
    backbone = tiny_backbone if dtype == "float32" else tiny(dtype=dtype)
    metrics, objs = decode(cfg, backbone)
    assert metrics["lossless"], [it.get("first_divergence") for it in objs["results"]["items"]]
    assert metrics["tree_steps"] > 0  # the draft did propose trees
    engine = objs["engine"]
    assert isinstance(engine.proposer, EagleProposer) and not engine.proposer.kv.sequences
    assert type(engine.proposer.kv) is type(engine.kv) and engine.proposer.kv.n_layers == 1
    assert objs["results"]["summary"]["tree"]["dynamic"]
    assert isinstance(engine.proposer.draft.block.w2, Int4) == (dtype == "q4")
    assert objs["results"]["summary"]["tree"]["draft_storage"] == ("q4" if dtype == "q4" else "float32")


def test_best_prefix_maximises_predicted_tokens_per_ms():
    from components.proposer.policy import best_prefix
    costs = {0: 10.0, 1: 11.0, 2: 12.0, 4: 20.0}
    assert best_prefix([0.9, 0.8, 0.1, 0.05], costs) == 2  # 2.7 / 12 beats 1.9 / 11 and 2.85 / 20
    assert best_prefix([0.05, 0.01], costs) == 0  # 1.05 / 11 < 1 / 10: a plain step
    assert best_prefix([0.15], costs) == 1 and best_prefix([0.15], costs, min_gain=1.1) == 0
    assert best_prefix([], costs) == 0


@pytest.mark.parametrize("regime", ["measured", "rows_free", "rows_dear"])
def test_tree_eagle_sized_per_step_is_lossless(trained, tiny_backbone, tmp_path, regime):
    """nodes=auto sizes each step's tree on the step costs: lossless whatever it picks; free rows
    verify every kept draft, dear rows make every step plain."""
    from pipeline.decode import decode
    path, _, _ = trained
    cfg = compose_config(["decode=tree_eagle", "model=tiny", f"proposer.checkpoint={path}", "tree.width=3",
                          "tree.depth=3", "tree.max_nodes=6", "proposer.nodes=auto", "max_new_tokens=24",
                          "stream=false", "batch_size=2", "verify_lossless=true", "chat=false"],
                         output_dir=tmp_path, input=str(tmp_path / "in.jsonl"))
    prompts = ["one two three one two three", "hello there", "a b a b a b"]
    (tmp_path / "in.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "{p}"}}\n' for i, p in enumerate(prompts)))
    original = EagleProposer._measure

    def measure(self):
        original(self)
        if regime != "measured":
            self.costs = {n: 1e3 if regime == "rows_free" or n > 0 else 1.0 for n in self.costs}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleProposer, "_measure", measure)
        metrics, objs = decode(cfg, tiny_backbone)
    assert metrics["lossless"], [it.get("first_divergence") for it in objs["results"]["items"]]
    tree = objs["results"]["summary"]["tree"]
    assert tree["nodes"] == "auto" and set(tree["step_ms_by_drafts"]) >= {0, 6}
    if regime == "rows_dear":
        assert metrics["tree_steps"] == 0 and tree["plain_step_share"] == 1.0
    if regime == "rows_free":
        assert metrics["tree_steps"] > 0 and tree["mean_drafts"] > 3


def test_training_prompts_stay_apart_from_benchmark_prompts_by_similarity():
    from components.data.prompts import _pool, available_prompts, similar, training_prompts
    assert similar("Define the word 'photosynthesis'.")  # a paraphrase of a benchmark prompt
    assert not similar("Write a haiku about a lighthouse at dawn in winter.")
    pool = sum(len(g) for g in _pool())
    assert 0 < pool - available_prompts() < pool // 10
    assert not any(similar(p) for p in training_prompts(3000))
    tuning = [json.loads(line)["prompt"] for line in (REPO_ROOT / "pipeline" / "prompts" / "tuning.jsonl").open()]
    assert len(tuning) == 16 and not set(tuning) & set(training_prompts(available_prompts()))


def test_a_new_benchmark_prompt_is_another_data_set(tmp_path, monkeypatch):
    """The data config names the kept prompts by digest: a benchmark file that leaves out other
    training prompts gives another data directory, never a stale set under the old name."""
    import shutil
    import components.data.prompts as prompts
    before, first = prompts.prompt_filter(), prompts.training_prompts(1)[0]
    bench = tmp_path / "prompts"
    shutil.copytree(prompts.BENCH_DIR, bench)
    (bench / "extra.jsonl").write_text(json.dumps({"prompt": prompts.training_prompts(1)[0]}) + "\n")
    monkeypatch.setattr(prompts, "BENCH_DIR", bench)
    for f in (prompts._benchmark, prompts._kept):
        f.cache_clear()
    try:
        assert prompts.prompt_filter() != before
        assert first not in prompts.training_prompts(prompts.available_prompts())
    finally:
        monkeypatch.undo()
        for f in (prompts._benchmark, prompts._kept):
            f.cache_clear()
    assert prompts.prompt_filter() == before


def test_a_draft_trained_with_prompt_context_reads_the_prompt(trained, tiny_backbone, tmp_path):
    """data.context=true: each answer part gets its prompts' pairs (the prompt tokens after each
    position; the last prompt state recomputed equals the answer's first, checked when built), the
    draft trains over prompt + answer with no loss on the prompt, its checkpoint says so, and
    tree_eagle with it puts the prompt into the draft cache and stays lossless."""
    from pipeline.core import encode_chat
    from pipeline.decode import decode
    from pipeline.train import train
    from components.data.prompts import training_prompts
    from components.data.self_distill import build_self_distill
    path, _, _ = trained
    data = path.parent.parent / "data"
    cfg = compose_config([*TRAIN, "trainer.max_steps=2", "data.context=true", "module.unroll=2", f"heads.init={path}",
                          f"data.root={data}"], config_name="train", output_dir=tmp_path / "run")
    metrics, objs = train(cfg)
    ds = objs["data"].train_set
    assert ds.context is not None and ds.context.samples == ds.samples
    full = build_self_distill(tiny_backbone, max_samples=24, max_new_tokens=16, batch_size=12, root=str(data), context=True)
    prompt = encode_chat(tiny_backbone.tokenizer, None, training_prompts(24)[5], True)
    c = full.context
    assert c.tokens[int(c.offsets[5]):int(c.offsets[6])].tolist() == prompt[1:]
    assert metrics["steps"] == 2 and 0 <= metrics["val/head1_top1"] <= 1
    draft_path = tmp_path / "run" / "heads.safetensors"
    assert EagleDraft.load(draft_path, tiny_backbone).info["context"] == "prompt"
    assert EagleDraft.load(path, tiny_backbone).info["context"] == "answer"
    out = tmp_path / "dec"
    dcfg = compose_config(["decode=tree_eagle", "model=tiny", f"proposer.checkpoint={draft_path}", "tree.width=3",
                           "tree.depth=3", "tree.max_nodes=6", "proposer.nodes=null", "max_new_tokens=24", "stream=false",
                           "batch_size=2", "verify_lossless=true", "chat=false"], output_dir=out, prompt="one two three one two")
    m, o = decode(dcfg, tiny_backbone)
    assert m["lossless"] and o["results"]["summary"]["tree"]["draft_context"] == "prompt"
    dim = tiny_backbone.model.args.dim
    for ckpt, kept in ((draft_path, 5), (path, 1)):  # the prefill's pairs the draft keeps
        prop = EagleProposer(tiny_backbone, functools.partial(ContiguousKV, max_len=64), str(ckpt))
        prop.start(0, [1, 2, 3, 4, 5])
        prop.observe(0, [2, 3, 4, 5, 6], torch.randn(5, dim))
        assert len(prop.seqs[0].tokens) == kept


def test_zero_steps_validate_the_draft_it_starts_from():
    """trainer.max_steps=0 heads.init=<draft>: the schedule takes 0 steps (the job only validates, how a
    draft's held-out accuracy on one prompt source is measured); a negative count is a one-line error."""
    from components.heads.module import warmup_cosine
    from pipeline.errors import UserError
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert warmup_cosine(opt, 0).get_last_lr() == [1.0 / 50]
    with pytest.raises(UserError, match="total_steps must be an int >= 0"):
        warmup_cosine(opt, -1)
