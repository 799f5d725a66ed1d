"""End-to-end: `launch_server --dp-size 2`: two replicas behind sglang-router (cache_aware).

A shared-prefix workload stays on the replica that holds the prefix (both replicas serve); /generate,
streaming chat and /v1/chat/completions through the router equal each replica's own answer; the router
registers the replicas through /server_info and /model_info (no deprecation fallback); a replica killed
mid-load loses no request that had not started on it and the launcher reports it; SIGTERM leaves no
process behind. Skipped when sglang-router is not installed (`make install` installs it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from server_e2e_helpers import SERVER_ARGS, pid_alive, server_info, sse_events, wait_idle

from treespec.args import router_installed
from treespec.server.testing import start_server

pytestmark = pytest.mark.skipif(not router_installed(),
                                reason="sglang-router is not installed (pip install 'treespec[router]')")

PREFIXES = ["You are a support agent for a bicycle shop. Policies: returns within 30 days with a receipt; "
            "repairs take two working days; helmets are never refunded once worn. Question: ",
            "Translate the following sentences from English into plain French, keeping names as they are, "
            "and answer with the translation only. Sentence: "]
QUESTIONS = ["Can I return a tyre?", "How long is a repair?", "Is a worn helmet refundable?", "Do you sell bells?"]


@pytest.fixture(scope="module")
def dp_server():
    srv = start_server([*SERVER_ARGS, "--dp-size", "2"])
    try:
        srv.wait_ready()
        srv.replica_urls = re.search(r"replicas (.+)\)", srv.log_tail(1 << 20)).group(1).split()
        yield srv
    finally:
        srv.terminate()


def finished(url: str) -> int:
    return server_info(url)["stats"]["num_finished"]


def generate(url: str, text: str, max_new_tokens: int = 2) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_shared_prefix_stays_on_the_replica_that_has_it(dp_server):
    """Each prefix group lands whole on one replica, and every repeat of a prefix finds it cached there
    (a repeat sent to the other replica would find nothing cached)."""
    urls = dp_server.replica_urls
    assert len(urls) == 2
    for prefix in PREFIXES:
        prefix_len = len(httpx.post(f"{urls[0]}/tokenize", json={"prompt": prefix}).json()["tokens"])
        before = [finished(u) for u in urls]
        metas = [generate(dp_server.base_url, prefix + q)["meta_info"] for q in QUESTIONS]
        delta = [finished(u) - b for u, b in zip(urls, before, strict=True)]
        assert sorted(delta) == [0, len(QUESTIONS)], delta
        assert all(m["cached_tokens"] >= prefix_len - 2 for m in metas[1:]), (prefix_len, metas)
        hit_rate = sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)
        print(f"prefix of {prefix_len} tokens: all {len(QUESTIONS)} requests on replica "
              f"{delta.index(len(QUESTIONS))}, cache hit rate {hit_rate:.2f}")


def test_generate_and_chat_through_the_router_equal_each_replica(dp_server):
    text = "The capital of France is"
    direct = [generate(u, text, 8)["text"] for u in dp_server.replica_urls]
    assert direct[0] == direct[1] and generate(dp_server.base_url, text, 8)["text"] == direct[0]
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(f"{u}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]
               ["content"] for u in [*dp_server.replica_urls, dp_server.base_url]]
    assert answers[0] == answers[1] == answers[2]
    with httpx.stream("POST", f"{dp_server.base_url}/v1/chat/completions", json={**chat, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] is None  # [DONE]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == answers[0]


def test_router_uses_the_current_info_routes(dp_server):
    for url in dp_server.replica_urls:
        for path in ("/server_info", "/model_info", "/get_server_info", "/get_model_info"):
            assert httpx.get(f"{url}{path}", timeout=30).status_code == 200
    assert "deprecat" not in dp_server.log_tail(1 << 20).lower()


async def _load(base_url: str, n: int, kill_after: int, kill) -> list[int]:
    """n concurrent requests sent 0.1 s apart; kill() once `kill_after` are sent. Their statuses."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> int:
            body = {"text": f"Request {i}: tell a long story about the number {i}.",
                    # long enough to outlast the 0.2 s between two requests to one replica, so the kill
                    # finds some in flight: at 24 tokens a faster decode finished them first (0 in flight)
                    "sampling_params": {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0}}
            try:
                return (await client.post(f"{base_url}/generate", json=body)).status_code
            except httpx.HTTPError:
                return -1
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.1)
            if i + 1 == kill_after:
                kill()
        return list(await asyncio.gather(*tasks))


def test_killed_replica_is_routed_around_and_reported(dp_server):
    victim_url, survivor_url = dp_server.replica_urls[1], dp_server.replica_urls[0]
    pids = server_info(victim_url)["pids"]
    in_flight = {}

    def kill() -> None:
        stats = server_info(victim_url)["stats"]
        in_flight["n"] = stats["num_running_reqs"] + stats["num_waiting_reqs"]
        os.kill(pids["launcher"], signal.SIGKILL)

    served_before = finished(survivor_url)
    statuses = asyncio.run(_load(dp_server.base_url, 16, 8, kill))
    failed = sum(s != 200 for s in statuses)
    print(f"killed replica 1 with {in_flight['n']} requests on it; {failed} of {len(statuses)} failed")
    assert in_flight["n"] > 0 and finished(survivor_url) > served_before  # the load went to both replicas
    assert failed <= in_flight["n"]  # only requests already running on the killed replica may fail
    assert statuses[8:] == [200] * 8  # every request sent after the kill completed elsewhere
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids.values()):  # its scheduler and detokenizer follow it
        assert time.monotonic() < deadline, pids
        time.sleep(0.2)
    assert re.search(r"replica 1 \(http://127\.0\.0\.1:\d+, pid \d+\) exited with code -9; removed from the "
                     r"router; serving with 1 of 2 replicas", dp_server.log_tail(1 << 20))
    assert generate(dp_server.base_url, "Still serving?")["meta_info"]["completion_tokens"] == 2
    assert wait_idle(survivor_url)["kv_pool_balanced"] is True


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError):
                pass
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_sigterm_leaves_no_process_behind(dp_server):
    launcher = dp_server.proc.pid
    pids = [launcher, *_children(launcher)]  # the replicas, the router, multiprocessing's resource tracker
    pids += [p for kid in pids[1:] for p in _children(kid)]  # each replica's scheduler and detokenizer
    assert len(pids) >= 6, pids
    assert dp_server.terminate() == 0, dp_server.log_tail()
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if pid_alive(p)]
        time.sleep(0.2)


def test_replica_that_fails_to_start_stops_everything():
    """A replica that cannot start (here: no such model) ends the launcher with 1, its reason in the log,
    and the other replica stopped (no router is started)."""
    srv = start_server(["--dp-size", "2", "--model-path", "/nonexistent/model", "--skip-warmup"])
    try:
        rc = srv.proc.wait(120)
        log = srv.log_tail(1 << 20)
    finally:
        srv.terminate()
    assert rc == 1, log
    assert "does not exist" in log and re.search(r"replica \d \(http://127\.0\.0\.1:\d+, pid \d+\) exited during "
                                                 r"start-up with code 1", log), log
