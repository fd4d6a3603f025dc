"""Self-distillation data across machines: shard jobs (`data.shard=i data.num_shards=n`) write
disjoint parts of the grid one job writes, and any job without a shard reads them (completing
what is missing) into exactly the set one job makes, token for token and state for state; a
data-only job (`data.only=true`) makes its parts and trains nothing; the trainer config passes
Lightning's multi-node knobs through."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from components.data.self_distill import build_self_distill, make_self_distill, parts, todo
from pipeline.errors import UserError

from helpers import PYTHON, REPO_ROOT, compose_config, subprocess_env

# 10 answers in parts of 2 (gen batch 2 x save_every 1): five cells, shard 0 of 2 owns cells 0, 2, 4
SET = dict(max_samples=10, max_new_tokens=8, batch_size=2, save_every=1)


def _names(out) -> list[str]:
    return [p.name for _, _, p in parts(out)]


def _same(a, b) -> None:
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.tokens, b.tokens)
    assert a.hidden.dtype == b.hidden.dtype and torch.equal(a.hidden, b.hidden)


@pytest.fixture(scope="module")
def one_job(tiny_backbone, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    return build_self_distill(tiny_backbone, root=str(root), **SET), root


def test_the_grid_splits_missing_answers_into_disjoint_shards(tmp_path):
    assert todo(tmp_path, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert todo(tmp_path, 10, 4, 0, 2) == [(0, 4), (8, 10)] and todo(tmp_path, 10, 4, 1, 2) == [(4, 8)]
    (tmp_path / "part-000000-000003.safetensors").touch()  # a set made with other part sizes: its holes only
    assert todo(tmp_path, 10, 4, 0, 2) == [(3, 4), (8, 10)] and todo(tmp_path, 10, 4, 1, 2) == [(4, 8)]
    assert todo(tmp_path, 10, 4) == [(3, 7), (7, 10)]  # one job goes on from where the set stops
    (tmp_path / "part-000004-000008.safetensors").touch()
    assert todo(tmp_path, 10, 4) == [(3, 4), (8, 10)]


def test_two_shards_make_the_one_job_set(one_job, tiny_backbone, tmp_path):
    single, single_root = one_job
    root = str(tmp_path / "sharded")
    out, _ = make_self_distill(tiny_backbone, root=root, shard=0, num_shards=2, **SET)
    assert _names(out) == ["part-000000-000002.safetensors", "part-000004-000006.safetensors",
                           "part-000008-000010.safetensors"]  # its cells only
    with pytest.raises(UserError, match="shard 0 of 2"):  # a shard's job cannot read the set alone
        build_self_distill(tiny_backbone, root=root, shard=0, num_shards=2, **SET)
    make_self_distill(tiny_backbone, root=root, shard=1, num_shards=2, **SET)
    merged = build_self_distill(tiny_backbone, root=root, **SET)
    _same(merged, single)
    (single_dir,) = [p for p in single_root.iterdir() if p.is_dir()]
    assert out.name == single_dir.name and _names(out) == _names(single_dir)  # the same set, the same files
    assert json.loads((out / "manifest.json").read_text()) == json.loads((single_dir / "manifest.json").read_text())
    done = {p.name: p.stat().st_mtime_ns for _, _, p in parts(out)}
    build_self_distill(tiny_backbone, root=root, shard=1, num_shards=2, **SET)  # complete: reads, makes nothing
    assert {p.name: p.stat().st_mtime_ns for _, _, p in parts(out)} == done


def test_a_job_without_a_shard_completes_the_set(one_job, tiny_backbone, tmp_path):
    single, _ = one_job
    root = str(tmp_path / "partial")
    make_self_distill(tiny_backbone, root=root, shard=1, num_shards=3, **SET)  # cells 1 and 4
    _same(build_self_distill(tiny_backbone, root=root, **SET), single)
    with pytest.raises(UserError, match="data.shard"):
        make_self_distill(tiny_backbone, root=root, shard=3, num_shards=3, **SET)


def test_data_only_sweep_makes_the_parts_and_trains_nothing(one_job, tmp_path):
    """`python -m pipeline.train -m data.shard=0,1 data.num_shards=2 data.only=true`, jobs in
    parallel through the joblib launcher: the set one job makes, and no draft."""
    single, _ = one_job
    root = tmp_path / "data"
    args = ["-m", "model=tiny", "heads=eagle", "~logger", "data.shard=0,1", "data.num_shards=2", "data.only=true",
            f"data.max_samples={SET['max_samples']}", f"data.max_new_tokens={SET['max_new_tokens']}",
            f"data.gen_batch_size={SET['batch_size']}", f"data.save_every={SET['save_every']}", f"data.root={root}",
            "hydra/launcher=parallel", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    r = subprocess.run([PYTHON, "-m", "pipeline.train", *args], cwd=REPO_ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list((tmp_path / "sweep").rglob("heads.safetensors"))
    from components.model.load import tiny
    _same(build_self_distill(tiny(), root=str(root), **SET), single)


def test_trainer_takes_lightnings_multi_node_strategies():
    from hydra.utils import instantiate
    cfg = compose_config(["trainer.num_nodes=2", "trainer.strategy=ddp", "trainer.devices=2"], config_name="train")
    trainer = instantiate(cfg.trainer)
    assert trainer.num_nodes == 2 and type(trainer.strategy).__name__ == "DDPStrategy"
    assert trainer.world_size == 4
