"""Every model family served from its Hugging Face folder over HTTP, as users run it:
`scripts/serve.py --model_path=<folder>` in a subprocess for each folder under
tests/fixtures/tiny_models (listed, so a family added there is covered without an edit),
one server per folder shared by the checks, on the smallest buckets.

The server computes no prompt-token logprobs (logprob_start_len >= 0 is a 400), so each
row of transformers' prefill logits is read as the next-token distribution of one prefix:
one batched /generate of every prefix of the fixture tokens, max_new_tokens=1, greedy,
top-20 logprobs each (SGLang's and OpenAI's cap, of the fixtures' 256-token vocab).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "fixtures" / "tiny_models"
FOLDERS = sorted(p.name for p in TINY.iterdir() if (p / "ref_logits.npz").exists())
TOP = 20
ATOL = 1e-4  # f32 against transformers' f32 logits
NEAR_TIE = 1e-3  # logprob gaps this small may order differently; tighter ones are compared
# One server per folder, smallest plan: 1 DECODE, 2 EXTEND (fresh and over a prefix), no
# MIXED (--itl_target_ms=0), 2 samplers, 1 init_slot. 64 tokens hold the longest greedy
# prompt (20) and its 32 new tokens.
SERVE_FLAGS = dict(page_size=16, max_running_requests=4, max_prefill_tokens=64,
                   chunked_prefill_size=64, max_extend_seqs=1, decode_buckets=4,
                   extend_token_buckets=64, kv_len_buckets=64, max_total_tokens=1024,
                   max_top_logprobs=TOP, itl_target_ms=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """scripts/serve.py on one fixture folder, its output in a log file."""

    def __init__(self, name: str, log: Path) -> None:
        self.name, self.log = name, log
        self.url = f"http://127.0.0.1:{_free_port()}"
        flags = SERVE_FLAGS | {"model_path": TINY / name, "port": self.url.rsplit(":", 1)[1]}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "scripts" / "serve.py"),
                 *(f"--{k}={v}" for k, v in flags.items())],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"serve.py exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"not ready in {timeout} s:\n{self.output()}"
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def generate(self, body: dict[str, Any]) -> Any:
        r = self.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        """SIGTERM (graceful, as a user's Ctrl-C); `reap` waits for the exit."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        self.stop()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Servers:
    """The module's servers, each started once. The next selected folder's server starts
    while the current one warms up and is tested: the two start-ups (imports, compiles;
    about 10 s each) overlap, and the requests themselves take a fraction of a second."""

    def __init__(self, order: list[str], tmp: pytest.TempPathFactory) -> None:
        self.order, self.tmp = order, tmp
        self.started: dict[str, Served] = {}

    def start(self, name: str) -> Served:
        if name not in self.started:
            self.started[name] = Served(name, self.tmp.mktemp(name) / "serve.log")
        return self.started[name]

    def take(self, name: str) -> Served:
        s = self.start(name)
        i = self.order.index(name)
        if i + 1 < len(self.order):
            self.start(self.order[i + 1])
        return s


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory) -> Iterator[Servers]:
    """Torn down after every `served`: waits for every server it started to exit."""
    order = list(dict.fromkeys(  # the folders the selected tests use, in run order
        item.callspec.params["served"] for item in request.session.items
        if "served" in getattr(getattr(item, "callspec", None), "params", {})))
    pool = Servers(order, tmp_path_factory)
    try:
        yield pool
    finally:
        for s in pool.started.values():
            s.reap()


# Folders whose family another folder already serves here are slow-marked.
SAME_FAMILY = {"llama_tied", "llama_untied", "gemma3_wide"}


@pytest.fixture(scope="module", params=[
    pytest.param(f, marks=[pytest.mark.slow] if f in SAME_FAMILY else []) for f in FOLDERS])
def served(request, servers) -> Iterator[Served]:
    s = servers.take(request.param)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _check_top(top: list[list[Any]], ref_logits: np.ndarray, where: str) -> None:
    """`top` (the server's top-TOP [logprob, id, text] of one position) against
    transformers' logits [V] there: each logprob to ATOL, each rank's id where the
    reference's neighbours on both sides are more than NEAR_TIE away."""
    ref = _log_softmax(ref_logits)  # [V]
    lps = np.array([e[0] for e in top])  # [TOP]
    ids = np.array([e[1] for e in top])  # [TOP]
    assert len(top) == TOP, where
    np.testing.assert_allclose(lps, ref[ids], atol=ATOL, rtol=0, err_msg=where)
    order = np.argsort(-ref, kind="stable")
    gaps = -np.diff(ref[order])  # [V - 1]: gap below each rank
    for i in range(TOP):
        clear = gaps[i] > NEAR_TIE and (i == 0 or gaps[i - 1] > NEAR_TIE)
        if clear:
            assert ids[i] == order[i], f"{where}: rank {i} is {ids[i]}, not {order[i]}"


def _greedy_reference(name: str) -> dict[str, np.ndarray] | None:
    """Transformers' greedy run of the folder, wherever and under whatever prefix the
    family's fixture keeps it ("", "p0_", "greedy_"): {prompt_ids, greedy_ids,
    greedy_margins, last_logits}, or None."""
    keys = ("prompt_ids", "greedy_ids", "greedy_margins", "last_logits")
    for file in ("greedy.npz", "ref_logits.npz"):
        if not (TINY / name / file).exists():
            continue
        z = np.load(TINY / name / file)
        for prefix in sorted(k[:-len("greedy_ids")] for k in z.files
                             if k.endswith("greedy_ids")):
            if all(prefix + k in z.files for k in keys):
                return {k: z[prefix + k] for k in keys}
    return None


def test_logprobs_of_every_prefix_match_transformers(served):
    ref = np.load(TINY / served.name / "ref_logits.npz")
    tokens, logits = ref["tokens"].tolist(), ref["logits"]  # [T], [T, V]
    body = {"input_ids": [tokens[:k + 1] for k in range(len(tokens))],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": TOP}
    outs = served.generate(body)
    assert len(outs) == len(tokens)
    for k, out in enumerate(outs):
        where = f"{served.name}, position {k}"
        _check_top(out["meta_info"]["output_top_logprobs"][0], logits[k], where)
        lp, tok, _ = out["meta_info"]["output_token_logprobs"][0]
        assert out["output_ids"] == [tok]
        assert abs(lp - _log_softmax(logits[k]).max()) < ATOL, where  # greedy took the top


def test_greedy_matches_transformers(served):
    """32 greedy tokens where the fixture has transformers' (compared up to the first
    near-tie); otherwise its prefill logits pin the one next token after `tokens`."""
    ref = _greedy_reference(served.name)
    if ref is None:
        z = np.load(TINY / served.name / "ref_logits.npz")
        last = np.sort(_log_softmax(z["logits"][-1]))
        ref = {"prompt_ids": z["tokens"], "greedy_ids": z["logits"][-1:].argmax(-1),
               "greedy_margins": np.array([last[-1] - last[-2]]), "last_logits": z["logits"][-1]}
    want = ref["greedy_ids"].tolist()
    n = next((i for i, m in enumerate(ref["greedy_margins"]) if m < NEAR_TIE), len(want))
    out = served.generate({"input_ids": ref["prompt_ids"].tolist(), "return_logprob": True,
                           "top_logprobs_num": TOP,
                           "sampling_params": {"max_new_tokens": len(want), "temperature": 0,
                                               "ignore_eos": True}})
    assert out["output_ids"][:n] == want[:n]
    _check_top(out["meta_info"]["output_top_logprobs"][0], ref["last_logits"],
               f"{served.name}, greedy prompt")


def test_bad_requests_are_4xx_and_nothing_compiled_after_warm_up(served):
    info = served.http.get("/get_model_info").json()
    vocab = info["vocab_size"]
    bad = [({"input_ids": [1, vocab]}, "input_ids"),  # one past the vocab
           ({"text": "no tokenizer here"}, "token ids"),
           ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0},
            "logprob_start_len")]
    for body, says in bad:
        r = served.http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        assert says in r.text, r.text
    still = served.generate({"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert still["meta_info"]["completion_tokens"] == 4
    state = served.http.get("/get_server_info").json()["internal_states"][0]
    assert state["compiles_after_warmup"] == 0, served.output()
    assert served.proc.poll() is None
