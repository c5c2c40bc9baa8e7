"""Routing the int8 kernels' calls by row count (specserve/ops/int8_routes.py, csrc/gemm_q4_i8.c): a table
sends each row count to its path, every path gives the same bits for every row count, the table is chosen
from timings as documented, and its cache file is used when it fits and measured again when it does not."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specserve.ops import greedy_screen, int8_routes, kernels
from specserve.ops.int8_routes import Int8Call, RouteTable
from tests.kernel_support import int8_paths_to_test, requires_c_kernels
from tests.ops.test_gemm_q4_i8 import random_q4

pytestmark = requires_c_kernels

PREFILL_ROWS = 300  # a prompt chunk


@pytest.fixture
def restore_routes():
    saved = dict(kernels._routes)
    kernels._routes.clear()
    yield
    kernels._routes.clear()
    kernels._routes.update(saved)
    kernels.set_int8_path(None)


def forced_table(paths: list[str], rows: int) -> list[str]:
    """Row counts 1..rows on the paths in turn, so that neighbouring row counts take different paths."""
    return [paths[(r - 1) % len(paths)] for r in range(1, rows + 1)]


def test_a_forced_table_routes_each_row_count_to_its_path_with_the_same_bits(restore_routes):
    paths = int8_paths_to_test()
    rng = np.random.default_rng(11)
    n, k = 200, 256
    weight = random_q4(rng, n, k).for_int8_activations(2)
    x = torch.from_numpy((rng.standard_normal((PREFILL_ROWS, k)) * rng.uniform(0.1, 20, (PREFILL_ROWS, 1)))
                         .astype(np.float32))
    kernels.set_int8_path("portable")
    want = kernels.gemm_weight(x, weight.packed, weight.weight_format, None, n)
    table = forced_table(paths, 40)
    kernels.set_int8_routes("gemm", table)
    for rows in [*range(1, 41), PREFILL_ROWS]:
        path = table[min(rows, len(table)) - 1]
        assert kernels.int8_route("gemm", rows) == path
        before = kernels.int8_route_calls("gemm")
        got = kernels.gemm_weight(x[:rows], weight.packed, weight.weight_format, None, n)
        after = kernels.int8_route_calls("gemm")
        assert after[path] - before[path] == 1 and sum(after.values()) - sum(before.values()) == 1, (rows, path)
        assert torch.equal(got, want[:rows]), (rows, path)  # a row's bits: its path's and its batch's alike


def test_the_lm_head_screen_is_routed_by_its_rows_with_the_same_argmax(restore_routes):
    paths = int8_paths_to_test()
    torch.manual_seed(3)
    n, k = 300, 96
    weight = torch.randn(n, k)
    screen = greedy_screen.pack_argmax_screen(weight)
    packed = kernels.pack_gemm_weight(weight)
    x = torch.randn(40, k)
    want = torch.argmax(x @ weight.T, dim=-1)
    table = forced_table(paths, 40)
    kernels.set_int8_routes("screen", table)
    for rows in range(1, 41):
        before = kernels.int8_route_calls("screen")[table[rows - 1]]
        got = greedy_screen.lm_head_argmax(x[:rows], packed, *screen)
        assert kernels.int8_route_calls("screen")[table[rows - 1]] == before + 1, rows
        assert torch.equal(got, want[:rows]), (rows, table[rows - 1])


def test_set_int8_path_none_returns_to_the_remembered_routes(restore_routes):
    paths = int8_paths_to_test()
    kernels.set_int8_routes("gemm", forced_table(paths, 8))
    kernels.set_int8_path("portable")
    assert all(kernels.int8_route("gemm", r) == "portable" for r in range(1, 9))
    kernels.set_int8_path(None)
    assert [kernels.int8_route("gemm", r) for r in range(1, 9)] == forced_table(paths, 8)
    assert kernels.int8_route("gemm", 5000) == forced_table(paths, 8)[-1]  # larger calls: the last count's path


def test_routes_to_unknown_or_unrunnable_paths_are_refused(restore_routes):
    with pytest.raises(ValueError, match="kernel"):
        kernels.set_int8_routes("attention", ["portable"])
    with pytest.raises(ValueError, match="paths"):
        kernels.set_int8_routes("gemm", ["sse9"])
    with pytest.raises(ValueError, match="paths"):
        kernels.set_int8_routes("gemm", [])
    missing = [p for p in kernels.INT8_PATHS if p not in kernels.int8_paths()]
    for path in missing:
        with pytest.raises(ValueError, match="does not run"):
            kernels.set_int8_routes("gemm", ["portable", path])


def test_choose_keeps_the_previous_path_within_the_margin_and_switches_beyond_it():
    ms = 1e-3
    timings = {
        "avx512_vnni": {1: 4.0 * ms, 2: 4.4 * ms, 4: 5.0 * ms, 8: 7.0 * ms, 16: 12.0 * ms, 64: 40.0 * ms},
        "amx": {1: 7.0 * ms, 2: 4.3 * ms, 4: 4.95 * ms, 8: 6.0 * ms, 16: 8.0 * ms, 64: 20.0 * ms},
    }
    table = int8_routes.choose("gemm", timings, "avx512_vnni")
    # 2 and 4: amx faster by under MARGIN, so vnni stays; from 8 amx is faster by more
    assert table.starts == (1, 8) and table.paths == ("avx512_vnni", "amx")
    # the baseline holds one row against a path faster by less than MARGIN
    near = {"avx512_vnni": {1: 4.0 * ms, 2: 4.4 * ms}, "avx2": {1: 3.9 * ms, 2: 4.35 * ms}}
    assert int8_routes.choose("gemm", near, "avx512_vnni").paths == ("avx512_vnni",)
    assert int8_routes.choose("gemm", near).paths == ("avx2",)
    # one count where another path is much faster (a noisy timing of the one in use) moves nothing
    lone = {"avx512_vnni": {1: 4.0 * ms, 2: 9.0 * ms, 3: 5.0 * ms}, "avx2": {1: 6.0 * ms, 2: 6.0 * ms, 3: 7.0 * ms}}
    assert int8_routes.choose("gemm", lone, "avx512_vnni").paths == ("avx512_vnni",)
    # a path faster from some count on, to the last, takes those counts
    late = {"avx512_vnni": {1: 4.0, 8: 7.0, 64: 40.0}, "amx": {1: 7.0, 8: 6.0, 64: 20.0}}
    assert int8_routes.choose("gemm", late, "avx512_vnni").starts == (1, 8)
    tail = {"avx512_vnni": {1: 4.0, 8: 7.0, 64: 40.0, 128: 80.0}, "amx": {1: 7.0, 8: 7.5, 64: 20.0, 128: 30.0}}
    assert int8_routes.choose("gemm", tail, "avx512_vnni").describe() == "gemm: rows 1-63 avx512_vnni, rows 64+ amx"
    tail["amx"][64] = 45.0  # a win at the last count alone is a lone timing
    assert int8_routes.choose("gemm", tail, "avx512_vnni").paths == ("avx512_vnni",)
    assert [table.path_for(r) for r in (1, 2, 7, 8, 9, 1000)] == ["avx512_vnni"] * 3 + ["amx"] * 3
    assert table.per_row() == ["avx512_vnni"] * 7 + ["amx"]
    assert table.describe() == "gemm: rows 1-7 avx512_vnni, rows 8+ amx"
    assert int8_routes.choose("gemm", {"avx2": {1: 1.0, 4: 2.0}}).paths == ("avx2",)


def test_measure_times_every_runnable_path_it_keeps_over_the_model_calls(restore_routes):
    rng = np.random.default_rng(2)
    weight = random_q4(rng, 64, 128).for_int8_activations(2)
    seen = []

    def run(x):
        seen.append((kernels.int8_route("gemm", x.shape[0]), x.shape[0]))
        return kernels.gemm_weight(x, weight.packed, weight.weight_format, None, 64)

    calls = [Int8Call(128, ("q4", 64), run)] * 16
    timings = int8_routes.measure("gemm", calls, kernels.int8_paths(), rows_measured=(1, 2, 40), repeats=2)
    assert timings and set(timings) <= set(kernels.int8_paths())
    assert all(t > 0 for per_rows in timings.values() for t in per_rows.values())
    assert {path for path, _ in seen} == set(kernels.int8_paths())  # each path ran under its own route
    inputs = {128: torch.randn(512, 128)}
    for rows, share in ((2, 16), (40, 12), (512, 1)):  # above FULL_PASS_ROWS rows a share: the work of 32 rows
        seen.clear()
        int8_routes._timed("gemm", "portable", calls, inputs, rows)
        assert seen == [("portable", rows)] * share


class FakeWorkload:
    """One GEMM call whose tables `measure` and `choose` are replaced by counted stand-ins: the cache logic
    alone is tested."""

    def __init__(self, monkeypatch, tmp_path, table: RouteTable):
        self.measured = 0
        self.file = tmp_path / "routes.json"
        rng = np.random.default_rng(4)
        weight = random_q4(rng, 32, 64).for_int8_activations(2)
        self.workloads = {"gemm": [Int8Call(64, ("q4", 32), lambda x: kernels.gemm_weight(
            x, weight.packed, weight.weight_format, None, 32))]}

        def fake_measure(kernel, calls, paths, rows_measured=None, repeats=0):
            self.measured += 1
            return {path: {1: 1.0} for path in table.paths}

        monkeypatch.setattr(int8_routes, "measure", fake_measure)
        monkeypatch.setattr(int8_routes, "choose", lambda kernel, timings, baseline=None: table)
        monkeypatch.setattr(int8_routes, "cache_file", lambda: self.file)
        monkeypatch.delenv(kernels.INT8_PATH_ENV, raising=False)

    def ensure(self) -> dict[str, RouteTable]:
        return int8_routes.ensure_routes(self.workloads)


def test_the_table_is_measured_once_then_read_from_its_file(monkeypatch, tmp_path, restore_routes):
    paths = kernels.int8_paths()
    table = RouteTable("gemm", (1, 3), (paths[-1], paths[0]))
    fake = FakeWorkload(monkeypatch, tmp_path, table)
    assert fake.ensure() == {"gemm": table} and fake.measured == 1
    assert [kernels.int8_route("gemm", r) for r in (1, 2, 3, 500)] == [paths[-1], paths[-1], paths[0], paths[0]]
    kernels.set_int8_routes("gemm", ["portable"], remember=False)
    assert fake.ensure() == {"gemm": table} and fake.measured == 1  # from the file
    assert kernels.int8_route("gemm", 1) == paths[-1]
    data = json.loads(fake.file.read_text())
    assert data["cpu"] == kernels.cpu_model() and len(data["entries"]) == 1


@pytest.mark.parametrize("spoil", ["garbage", "other_cpu", "other_version", "unrunnable_path", "bad_starts",
                                   "missing_kernel", "wrong_types"])
def test_a_corrupted_or_stale_cache_file_is_measured_again(monkeypatch, tmp_path, restore_routes, spoil):
    paths = kernels.int8_paths()
    table = RouteTable("gemm", (1,), (paths[-1],))
    fake = FakeWorkload(monkeypatch, tmp_path, table)
    fake.ensure()
    data = json.loads(fake.file.read_text())
    entry = next(iter(data["entries"].values()))
    if spoil == "garbage":
        fake.file.write_text('{"version": 1, "cpu": ')
    else:
        if spoil == "other_cpu":
            data["cpu"] = "Some Other CPU"
        elif spoil == "other_version":
            data["version"] = 0
        elif spoil == "unrunnable_path":
            entry["tables"]["gemm"]["paths"] = ["amx_emulated" if "amx" in paths else "amx"]
        elif spoil == "bad_starts":
            entry["tables"]["gemm"] = {"starts": [2], "paths": [paths[0]]}
        elif spoil == "missing_kernel":
            del entry["tables"]["gemm"]
        elif spoil == "wrong_types":
            entry["tables"]["gemm"] = {"starts": "1", "paths": paths[0]}
        fake.file.write_text(json.dumps(data))
    assert fake.ensure() == {"gemm": table} and fake.measured == 2
    assert json.loads(fake.file.read_text())["cpu"] == kernels.cpu_model()  # rewritten whole
    assert fake.ensure() == {"gemm": table} and fake.measured == 2


@pytest.mark.parametrize("how", ["environment", "set_int8_path"])
def test_a_forced_path_is_not_measured_and_not_routed(monkeypatch, tmp_path, restore_routes, how):
    table = RouteTable("gemm", (1,), ("avx2",))
    fake = FakeWorkload(monkeypatch, tmp_path, table)
    if how == "environment":
        monkeypatch.setenv(kernels.INT8_PATH_ENV, "portable")
    kernels.set_int8_path("portable")
    assert fake.ensure() == {} and fake.measured == 0 and not fake.file.exists()
    assert kernels.int8_route("gemm", 7) == "portable"


def test_a_model_routes_its_own_calls(restore_routes, default_gguf_path):
    """The default model's int8 calls (its 4-bit projections and its LM head's screen) are what is routed:
    loading it sets both kernels' tables, each a path this CPU runs, from the measured or cached timings."""
    from specserve.models.linear import int8_workloads
    from specserve.llm import LLM

    llm = LLM(model=default_gguf_path, max_model_len=256)
    workloads = int8_workloads(llm.llm_engine.runner.model)
    assert len(workloads["gemm"]) == 4 * llm.llm_engine.runner.model.config.num_hidden_layers
    assert len(workloads["screen"]) == 1
    tables = int8_routes.ensure_routes(workloads)  # the engine's own call made them; this one reads them back
    assert set(tables) == {"gemm", "screen"}
    for kernel, table in tables.items():
        assert set(table.paths) <= set(kernels.int8_paths())
        assert [kernels.int8_route(kernel, r) for r in range(1, 65)] == [table.path_for(r) for r in range(1, 65)]


def test_a_measurement_that_fails_leaves_the_routes_as_they_were(monkeypatch, tmp_path, restore_routes):
    paths = int8_paths_to_test()
    kernels.set_int8_routes("gemm", forced_table(paths, 4))
    fake = FakeWorkload(monkeypatch, tmp_path, RouteTable("gemm", (1,), (paths[0],)))

    def failing_measure(kernel, calls, runs, rows_measured=None, repeats=0):
        kernels.set_int8_routes(kernel, ["portable"], remember=False)  # as measure forces paths
        raise RuntimeError("a call failed")

    monkeypatch.setattr(int8_routes, "measure", failing_measure)
    with pytest.raises(RuntimeError, match="a call failed"):
        fake.ensure()
    assert [kernels.int8_route("gemm", r) for r in range(1, 5)] == forced_table(paths, 4)
    assert not fake.file.exists()
