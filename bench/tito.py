"""TITO gateway bench: gateway vs a naive re-render/re-encode loop, on two real tokenizers.

    python bench/tito.py [--quick] [--json] [--write-corpus]

The sampled tokens are *replayed* from a committed corpus (``bench/data/tito_corpus_*.jsonl``),
not sampled by a model: per tokenizer, seeded multi-turn agent sessions whose completions are
non-canonical but well-formed tool-call token sequences -- JSON with unusual spacing and key
order, ``false``/``null`` literals, escaped and unescaped unicode, words split across BPE
pieces (``H`` + ``AVING``), optional reasoning blocks, parallel tool calls -- each of which
the renderer parses into exactly the intended tool calls. ``--write-corpus`` regenerates the
files deterministically from the seeds.

Each session runs through the gateway's FastAPI app in process (an ASGI call, no sockets) with
a harness that re-serialises the assistant turns it sends back (other JSON spacing, Python
literals such as ``False``) and drops reasoning. Per session:

- gateway drift: the session buffer's sampled tokens differ from the engine's own record, the
  TITO invariant fails on some turn, a segment had to be started, or the drift counter moved
  (measured with ``bridge_to_next_turn``, and again with the two-render difference in its
  place: ``gateway_drift_sessions_render_diff``);
- naive drift: re-rendering the harness's messages and re-encoding them does not reproduce the
  sampled tokens at their positions.

``gateway_overhead_ms`` is the median over requests of (gateway request latency - direct
replay-engine latency for the same completion).

``turn_overhead_ms`` (bench/turn_overhead.py): what one turn of a sticky agentic session costs
the gateway, the scheduler and the cell on the real app and a real cell command handler and
engine, decode excluded, at contexts of 1k, 8k, 32k and 128k tokens, each turn adding 200 new
tokens (median over the measured turns); ``turn_overhead_ratio_128k_over_1k`` the 128k figure
over the 1k one (goal <= 2: a turn costs what is new, not the context). Last stdout line: one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import add_target_args, finish  # noqa: E402
from turn_overhead import measure as measure_turns  # noqa: E402

from scheduler.contract.sampling import SamplingParams  # noqa: E402
from scheduler.gateway.router import make_chat_router  # noqa: E402
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine, echo_assistant  # noqa: E402
from scheduler.gateway.tito.render import ChatRenderer, load_renderer  # noqa: E402
from scheduler.gateway.tito.tito import naive_rerender_drift  # noqa: E402

DATA = ROOT / "bench" / "data"
RENDERERS = ("qwen3", "deepseek-v3")
CORPUS_SESSIONS = 64
QUICK_SESSIONS = 50
CORPUS_SEED = 20240611

# ------------------------------------------------------------------------------ corpus
TOOLS: dict[str, dict] = {
    "read_file": {
        "description": "Read a range of lines from a file in the repository.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "start_line": {"type": "integer"},
                "end_line": {"type": "integer"},
                "strip": {"type": "boolean"},
            },
            "required": ["path"],
        },
    },
    "run_sql": {
        "description": "Run a read-only SQL query against the analytics database.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "explain": {"type": "boolean"},
                "limit": {"type": "integer"},
            },
            "required": ["query"],
        },
    },
    "search_code": {
        "description": "Search the code base for a pattern.",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string"},
                "case_sensitive": {"type": "boolean"},
                "globs": {"type": "array", "items": {"type": "string"}},
                "max_results": {"type": "integer"},
            },
            "required": ["pattern"],
        },
    },
    "write_file": {
        "description": "Write a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "overwrite": {"type": "boolean"},
            },
            "required": ["path", "content"],
        },
    },
    "http_get": {
        "description": "Fetch a URL.",
        "parameters": {
            "type": "object",
            "properties": {
                "url": {"type": "string"},
                "headers": {"type": "object"},
                "timeout_s": {"type": "number"},
                "follow_redirects": {"type": "boolean"},
            },
            "required": ["url"],
        },
    },
}

PATHS = [
    "a.py",
    "src/app/main.py",
    "lib/données.py",
    "docs/数据.md",
    "tests/test_io.py",
    "README.md",
]
WORDS = [
    "HAVING",
    "config",
    "déjà",
    "naïve",
    "数据",
    "retry",
    "timeout",
    "GROUP",
    "Flag",
    "None",
    "false",
]
SQL = [
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1",
    "SELECT id FROM orders WHERE total>100 AND status='open'",
    "select   region ,sum(amount) from sales group by region having sum(amount)>=0.5",
]


def _args_for(name: str, rng: random.Random) -> dict:
    if name == "read_file":
        a: dict = {"path": rng.choice(PATHS)}
        if rng.random() < 0.7:
            a["start_line"] = rng.randint(1, 50)
            a["end_line"] = a["start_line"] + rng.randint(0, 80)
        if rng.random() < 0.5:
            a["strip"] = rng.random() < 0.5
        return a
    if name == "run_sql":
        a = {"query": rng.choice(SQL), "explain": rng.random() < 0.3}
        if rng.random() < 0.5:
            a["limit"] = rng.choice([10, 100, None])
        return a
    if name == "search_code":
        a = {
            "pattern": rng.choice(WORDS) + rng.choice(["", r"\(", "_v2", " = "]),
            "case_sensitive": rng.random() < 0.5,
        }
        if rng.random() < 0.6:
            a["globs"] = rng.sample(["*.py", "*.md", "src/**", "tests/*"], rng.randint(1, 3))
        if rng.random() < 0.4:
            a["max_results"] = rng.randint(1, 200)
        return a
    if name == "write_file":
        body = rng.choice(
            [
                "def f(x):\n    return x  # HAVING\n",
                "flag = False\nvalue = None\n",
                '{"k": [1, 2, 3]}\n',
                "naïve déjà vu\n\n",
            ]
        )
        return {"path": rng.choice(PATHS), "content": body, "overwrite": rng.random() < 0.5}
    a = {"url": "https://example.com/api/" + rng.choice(["v1/items", "données", "q?x=1&y=false"])}
    if rng.random() < 0.6:
        a["headers"] = {"Accept": "application/json", "X-Flag": rng.choice(["true", "0"])}
    if rng.random() < 0.5:
        a["timeout_s"] = rng.choice([0.5, 2.0, 10])
    a["follow_redirects"] = rng.random() < 0.5
    return a


def _dump(obj, rng: random.Random, style: dict) -> str:
    """JSON text in a non-canonical (but valid) style."""
    if isinstance(obj, dict):
        keys = list(obj)
        if style["shuffle"]:
            rng.shuffle(keys)
        items = [_dump(k, rng, style) + style["kv"] + _dump(obj[k], rng, style) for k in keys]
        inner = style["item"].join(items)
        return "{" + style["pad"] + inner + style["pad"] + "}" if items else "{}"
    if isinstance(obj, list):
        return "[" + style["item"].join(_dump(v, rng, style) for v in obj) + "]"
    if isinstance(obj, str):
        return json.dumps(obj, ensure_ascii=style["ascii"])
    if isinstance(obj, float):
        return rng.choice([repr(obj), f"{obj:.2f}"])
    return json.dumps(obj)


def _style(rng: random.Random) -> dict:
    return {
        "item": rng.choice([",", ", ", " , ", ",  "]),
        "kv": rng.choice([":", ": ", " : ", ":  "]),
        "pad": rng.choice(["", "", " "]),
        "shuffle": rng.random() < 0.5,
        "ascii": rng.random() < 0.3,
    }


def _encode_pieces(tok, text: str, rng: random.Random, split_rate: float) -> list[int]:
    """Encode ``text`` in pieces cut at random characters (a non-canonical tokenisation)."""
    text = unicodedata.normalize("NFC", text)
    cuts = set()
    i = text.find("HAVING")
    while i >= 0:
        cuts.add(i + 1)  # the 'H' + 'AVING' split (a BPE merge across the boundary)
        i = text.find("HAVING", i + 1)
    for j in range(1, len(text)):
        if rng.random() < split_rate:
            cuts.add(j)
    ids: list[int] = []
    prev = 0
    for c in sorted(cuts):
        ids += tok.encode(text[prev:c])
        prev = c
    ids += tok.encode(text[prev:])
    return ids


def _completion(
    renderer: ChatRenderer,
    calls: list[tuple[str, dict]],
    rng: random.Random,
    final_text: str | None,
) -> list[int]:
    tok = renderer.tokenizer
    style = _style(rng)
    split = rng.choice([0.0, 0.02, 0.08])
    ids: list[int] = []

    def text(t: str) -> None:
        ids.extend(_encode_pieces(tok, t, rng, split))

    def special(s: str) -> None:
        enc = tok.encode(s)
        assert len(enc) == 1, s
        ids.extend(enc)

    if renderer.name.startswith("qwen3"):
        if rng.random() < 0.4:
            special("<think>")
            text(
                "\n"
                + rng.choice(
                    [
                        "I should look at the file first.",
                        "Check the HAVING clause.",
                        "Two lookups at once.",
                    ]
                )
                + "\n"
            )
            special("</think>")
            text("\n\n")
        if final_text is not None:
            text(final_text)
        else:
            if rng.random() < 0.3:
                text(
                    rng.choice(["Let me check.", "I'll run both lookups.\n", "Looking déjà."])
                    + "\n"
                )
            for n, (name, args) in enumerate(calls):
                if n:
                    text("\n")
                special("<tool_call>")
                wrapper = {"name": name, "arguments": args}
                if rng.random() < 0.3:
                    wrapper = {"arguments": args, "name": name}
                text("\n" + _dump(wrapper, rng, style) + "\n")
                special("</tool_call>")
        special("<|im_end|>")
    else:
        if final_text is not None:
            text(final_text)
        else:
            if rng.random() < 0.4:
                text(rng.choice(["Let me check.", "I'll run both lookups.", "Looking déjà."]))
            special("<｜tool▁calls▁begin｜>")
            for name, args in calls:
                special("<｜tool▁call▁begin｜>")
                text("function")
                special("<｜tool▁sep｜>")
                text(f"{name}\n```json\n" + _dump(args, rng, style) + "\n```")
                special("<｜tool▁call▁end｜>")
            special("<｜tool▁calls▁end｜>")
        special("<｜end▁of▁sentence｜>")
    return ids


def _tool_result(name: str, args: dict, rng: random.Random) -> str:
    return rng.choice(
        [
            "\n1: import os\n2: FLAG = False\n3: def main():\n4:     return None\n",
            json.dumps({"rows": [["alice", 2], ["bob", 3]], "ok": True, "note": "données"}),
            f"{name} ok: " + json.dumps(args, ensure_ascii=False)[:60],
            "HTTP 200\nContent-Type: text/html\n\n<html>数据</html>",
            "(no output)",
            "\n\nerror: file not found",
        ]
    )


def build_session(renderer: ChatRenderer, index: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:{renderer.name}:{index}")
    names = rng.sample(sorted(TOOLS), rng.randint(2, 4))
    tools = [{"type": "function", "function": {"name": n, **TOOLS[n]}} for n in names]
    task = rng.choice(
        [
            "Find duplicate user names (use HAVING) and fix the report.",
            "Read the config and tell me whether retry is enabled.",
            "Search for naïve string handling and patch it.",
            "Fetch the items API and summarise the données.",
        ]
    )
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools."},
        {"role": "user", "content": task},
    ]
    n_tool_turns = rng.randint(2, 4)
    turns = []
    for k in range(n_tool_turns + 1):
        if k < n_tool_turns:
            calls = [(n, _args_for(n, rng)) for n in rng.choices(names, k=rng.choice([1, 1, 2, 3]))]
            final = None
        else:
            calls = []
            final = rng.choice(
                [
                    "Done. The query uses HAVING COUNT(*) > 1.",
                    "Retry is enabled: flag = false was wrong, fixed.",
                    "Patched the naïve handling in 2 files.",
                    "Résumé: 2 rows, ok = true.",
                ]
            )
        for _attempt in range(20):
            ids = _completion(renderer, calls, rng, final)
            parsed = renderer.parse_response(ids, tools, None)
            got = [(tc.name, tc.arguments) for tc in parsed.tool_calls if tc.status.value == "ok"]
            if got == calls and len(parsed.tool_calls) == len(calls):
                break
        else:  # pragma: no cover - generator bug
            raise RuntimeError(
                f"could not build a well-formed completion for {renderer.name} session {index}"
            )
        turn = {
            "completion_ids": ids,
            "expect_calls": [n for n, _ in calls],
            "tool_results": [_tool_result(n, a, rng) for n, a in calls],
            "user_followup": "Also check the tests, please."
            if (calls and k == 1 and rng.random() < 0.25)
            else None,
        }
        turns.append(turn)
    harness = rng.choice(
        ["json_default", "python_repr", "json_sorted_compact", "json_indent", "verbatim"]
    )
    return {
        "id": f"{renderer.name}-{index:03d}",
        "renderer": renderer.name,
        "harness": harness,
        "tools": tools,
        "messages": messages,
        "turns": turns,
    }


def corpus_path(name: str) -> Path:
    return DATA / f"tito_corpus_{name}.jsonl"


def write_corpus(n: int = CORPUS_SESSIONS, seed: int = CORPUS_SEED) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for name in RENDERERS:
        r = load_renderer(name)
        with open(corpus_path(name), "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(
                    json.dumps(build_session(r, i, seed), ensure_ascii=False, separators=(",", ":"))
                    + "\n"
                )


def load_corpus(name: str, limit: int | None = None) -> list[dict]:
    out = []
    with open(corpus_path(name), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


# ----------------------------------------------------------------------------- harness
def next_messages(messages: list[dict], response: dict, turn: dict, mode: str) -> list[dict]:
    msg = response["choices"][0]["message"]
    out = messages + [echo_assistant(msg, mode)]
    for tc, result in zip(msg.get("tool_calls") or [], turn["tool_results"], strict=False):
        out.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    if turn.get("user_followup"):
        out.append({"role": "user", "content": turn["user_followup"]})
    return out


def renderer_view(messages: list[dict]) -> list[dict]:
    """The harness's messages as a naive loop would hand them to the renderer."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


# --------------------------------------------------------------------------- ASGI call
async def asgi_post(app, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One in-process HTTP request to an ASGI app (no sockets, no client library)."""
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": hdrs,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    sent = False
    done = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    status = 0
    chunks: list[bytes] = []

    async def send(msg):
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    await app(scope, receive, send)
    done.set()
    return status, b"".join(chunks)


# ------------------------------------------------------------------------------- bench
async def run_tokenizer(name: str, n_sessions: int, use_bridge: bool = True) -> dict:
    from fastapi import FastAPI

    renderer = load_renderer(name)
    engine = ReplayEngine()
    backend = InMemoryBackend(engine)
    router = make_chat_router(backend, name, use_bridge=use_bridge)
    app = FastAPI()
    app.include_router(router)
    gw = router.gateway
    sessions = load_corpus(name, n_sessions)
    direct_engine = ReplayEngine()
    overheads: list[float] = []
    gateway_ms: list[float] = []
    turns_total = 0
    well_formed = 0
    naive_sessions = 0
    naive_tokens = 0
    gw_sessions = 0
    noncanonical = 0
    paths: dict[str, int] = {}
    # Warm-up (imports, first renders) outside the timed requests.
    warm = sessions[0]
    engine.script("warmup", [warm["turns"][-1]["completion_ids"]])
    await asgi_post(
        app,
        "/v1/chat/completions",
        json.dumps({"messages": warm["messages"]}).encode(),
        {"X-Session-Id": "warmup"},
    )
    for sess in sessions:
        sid = sess["id"]
        tools = sess["tools"]
        engine.script(sid, [t["completion_ids"] for t in sess["turns"]])
        messages = [dict(m) for m in sess["messages"]]
        naive_turns: list[tuple[list[dict], list[int]]] = []
        prompt_lens: list[int] = []
        ok_session = True
        gw_bad = False
        drift_before = gw.counters.retokenization_drift_total
        rewrites_before = gw.counters.history_rewrites_total
        for k, turn in enumerate(sess["turns"]):
            body = json.dumps(
                {"model": name, "messages": messages, "tools": tools, "seed": k}
            ).encode()
            t0 = time.perf_counter()
            status, raw = await asgi_post(app, "/v1/chat/completions", body, {"X-Session-Id": sid})
            t1 = time.perf_counter()
            direct_engine.script("direct", [turn["completion_ids"]])
            t2 = time.perf_counter()
            async for _ in direct_engine.generate(
                "direct", [], SamplingParams(stop_token_ids=list(renderer.stop_token_ids)), "d"
            ):
                pass
            t3 = time.perf_counter()
            gateway_ms.append((t1 - t0) * 1e3)
            overheads.append(((t1 - t0) - (t3 - t2)) * 1e3)
            turns_total += 1
            if status != 200:
                gw_bad = True
                break
            resp = json.loads(raw)
            choice = resp["choices"][0]
            if choice["token_ids"] != turn["completion_ids"]:
                gw_bad = True
            calls = choice["message"].get("tool_calls") or []
            if [c["function"]["name"] for c in calls] != turn["expect_calls"]:
                ok_session = False
            prompt_lens.append(resp["usage"]["prompt_tokens"])
            naive_turns.append((renderer_view(messages), choice["token_ids"]))
            messages = next_messages(messages, resp, turn, sess["harness"])
            ids = turn["completion_ids"]
            if renderer.tokenizer.encode(renderer.tokenizer.decode(ids)) != ids:
                noncanonical += 1
        # The naive loop's record of the last completion is the full conversation's render.
        naive_turns.append((renderer_view(messages), []))
        stored = backend.sessions[sid]
        seg = stored.segments[-1]
        sampled = engine.sampled[sid]
        if len(stored.segments) != 1:
            gw_bad = True
        recorded = [t for t, m in zip(seg.token_ids, seg.loss_mask, strict=False) if m == 1]
        if recorded != [t for c in sampled for t in c]:
            gw_bad = True
        # TITO invariant on every turn: prompt[k+1] starts with prompt[k] + completion[k].
        for k in range(len(prompt_lens)):
            c = sampled[k]
            p = prompt_lens[k]
            if seg.token_ids[p : p + len(c)] != c:
                gw_bad = True
            if k + 1 < len(prompt_lens) and prompt_lens[k + 1] < p + len(c):
                gw_bad = True
        if (
            gw.counters.retokenization_drift_total != drift_before
            or gw.counters.history_rewrites_total != rewrites_before
        ):
            gw_bad = True
        nd = naive_rerender_drift(renderer, naive_turns, tools)
        if ok_session:
            well_formed += 1
            naive_sessions += nd > 0
            naive_tokens += nd
            gw_sessions += gw_bad
        await asgi_post(app, f"/v1/sessions/{sid}/finish", b'{"reward": 1.0}', {})
    for k, v in gw.stats.items():
        paths[k] = paths.get(k, 0) + v
    return {
        "sessions": well_formed,
        "turns": turns_total,
        "naive_drift_sessions": naive_sessions,
        "naive_drift_tokens": naive_tokens,
        "gateway_drift_sessions": gw_sessions,
        "retokenization_drift_total": gw.counters.retokenization_drift_total,
        "history_rewrites_total": gw.counters.history_rewrites_total,
        "noncanonical_completions": noncanonical,
        "overheads_ms": overheads,
        "gateway_ms": gateway_ms,
        "paths": paths,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_SESSIONS} sessions per tokenizer")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument(
        "--write-corpus", action="store_true", help="regenerate bench/data/tito_corpus_*.jsonl"
    )
    add_target_args(ap)
    args = ap.parse_args(argv)
    if args.write_corpus:
        write_corpus()
    n = QUICK_SESSIONS if args.quick else CORPUS_SESSIONS
    t0 = time.perf_counter()
    per: dict[str, dict] = {}
    for name in RENDERERS:
        per[name] = asyncio.run(run_tokenizer(name, n))
        # The same sessions with the two-render difference instead of the bridge.
        per[name]["render_diff"] = asyncio.run(run_tokenizer(name, n, use_bridge=False))
        if not args.json:
            r = per[name]
            print(
                f"{name:12s} sessions={r['sessions']} turns={r['turns']} naive_drift_sessions={r['naive_drift_sessions']} "
                f"gateway_drift_sessions={r['gateway_drift_sessions']} overhead_ms(median)={statistics.median(r['overheads_ms']):.3f} "
                f"paths={r['paths']}",
                flush=True,
            )
    turns = measure_turns(args.quick)
    if not args.json:
        for size, ms in turns["turn_overhead_ms"].items():
            print(f"turn at {turns['turn_context_tokens'][size]} tokens: {ms} ms {turns['turn_overhead_parts_ms'][size]}",
                  flush=True)
    overheads = [x for r in per.values() for x in r["overheads_ms"]]
    gateway_ms = [x for r in per.values() for x in r["gateway_ms"]]
    overheads.sort()
    result = {
        "tokenizers": list(RENDERERS),
        "sessions": sum(r["sessions"] for r in per.values()),
        "turns": sum(r["turns"] for r in per.values()),
        "naive_drift_sessions": sum(r["naive_drift_sessions"] for r in per.values()),
        "gateway_drift_sessions": sum(r["gateway_drift_sessions"] for r in per.values()),
        "gateway_drift_sessions_render_diff": sum(
            r["render_diff"]["gateway_drift_sessions"] for r in per.values()
        ),
        "gateway_overhead_ms": round(statistics.median(overheads), 3),
        "gateway_overhead_ms_mean": round(statistics.fmean(overheads), 3),
        "gateway_overhead_ms_p90": round(overheads[int(0.9 * (len(overheads) - 1))], 3),
        "gateway_latency_ms_median": round(statistics.median(gateway_ms), 3),
        "naive_drift_tokens": sum(r["naive_drift_tokens"] for r in per.values()),
        "retokenization_drift_total": sum(r["retokenization_drift_total"] for r in per.values()),
        "history_rewrites_total": sum(r["history_rewrites_total"] for r in per.values()),
        "noncanonical_completions": sum(r["noncanonical_completions"] for r in per.values()),
        "per_tokenizer": {
            k: {
                "sessions": r["sessions"],
                "turns": r["turns"],
                "naive_drift_sessions": r["naive_drift_sessions"],
                "gateway_drift_sessions": r["gateway_drift_sessions"],
                "paths": r["paths"],
                "render_diff_paths": r["render_diff"]["paths"],
                "gateway_drift_sessions_render_diff": r["render_diff"]["gateway_drift_sessions"],
            }
            for k, r in per.items()
        },
        "corpus": "replayed committed corpus bench/data/tito_corpus_*.jsonl (non-canonical, well-formed tool-call token sequences; not model samples)",
        **turns,
        "quick": bool(args.quick),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    finish(result, args, "tito", argv)


if __name__ == "__main__":
    main()
