#!/usr/bin/env python3
"""The policy arm: does a context policy make an agent fix more bugs, and at what cost?

An agent harness for QuixBugs (the repository's data/quixbugs) over `leyline serve`
with the official `openai` client. One task is one buggy program: a scratch copy of the QuixBugs
layout holding only that program (and `node.py`), its test, `load_testdata.py`, `conftest.py` and
its JSON cases; never the correct programs. The model works through four tools, called in its
chat template's tool format: `read_file` (with line numbers), `run_tests` (pytest, slow tests
skipped, a per-test timeout, short tracebacks, output trimmed), `replace_lines` (refused when
it would leave a syntax error) and `submit`. A task is solved when
its tests pass at submit. A reply with a tool call the server could not parse, or with none, is
answered with an error message, as debug-gym does. A task ends at submit, at the turn limit, at
the context limit or at the wall-clock cap.

Arms (what the server does with the history the harness sends, which is always all of it):
- `none`: the full history; the prefix cache alone (`leyline.mode: prefix`).
- `truncate`: `truncate_tool_outputs:2` (a tool output followed by more than 2 assistant
  messages becomes a stub), applied by the server (`leyline.context_management`) in a session
  (`X-Session-Id`), so each turn's edits are AMORTIZE splices of the cached context.
- `truncate_reprefill`: the same policy without a session: the prefix cache alone, so the
  tokens after each edit are prefilled again (what a serving engine without splices pays).
- `clear`: `clear_tool_uses` (trigger 3,000 input tokens, keep 2) in a session.

`run` appends one JSON line per finished (arm, seed, task) to --out and skips those already
there, so an interrupted run resumes. `report` reads that file and prints the comparison:
solve rate with a 95% Wilson interval, turns, tool calls, tokens, cache hit, time, and per
pair of arms the tasks that flip, McNemar's exact test and a bootstrap interval of the paired
difference. `transcripts` counts what the model did in the runs' transcripts (tool calls by
name, refused edits, empty and repeated replies).
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

# The harness configuration (prompts, tools, limits, arms) fixed for the benchmark. Each record
# carries it, and `run` will not add to a file of another one. 1: the pilot (17 runs; the
# server then ran on past `<|endoftext|>`). 2: edits that break the syntax are refused,
# pytest's short tracebacks, 256 tokens per reply. 3: sampled runs draw each turn with its own
# seed (2 sent the task's seed on every turn, so every turn replayed one random stream and
# the runs at seed 1 never made a tool call) and use the model card's top_p 0.8 and top_k 20;
# greedy runs are unchanged, so configuration 2's greedy records count as 3's.
HARNESS = 3
GREEDY_SAME_SINCE = 2

# Sampled runs: Qwen2.5's published generation settings (its repetition penalty of 1.05 is
# left out: the server refuses penalties rather than approximating them).
SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}

# How replace_lines' refusal of an edit that breaks the syntax begins (`transcripts` counts them).
EDIT_REFUSED = "the edit was not applied"

ARMS = {
    "none": {"session": False, "edits": None},
    "truncate": {"session": True,
                 "edits": [{"type": "truncate_tool_outputs", "older_than_turns": 2}]},
    "truncate_reprefill": {"session": False,
                           "edits": [{"type": "truncate_tool_outputs", "older_than_turns": 2}]},
    "clear": {"session": True,
              "edits": [{"type": "clear_tool_uses_20250919",
                         "trigger": {"type": "input_tokens", "value": 3000},
                         "keep": {"type": "tool_uses", "value": 2}}]},
}

SYSTEM = (
    "You are a careful software engineer fixing a bug in a small Python program. The program "
    "has exactly one defective line. Work only through the tools: read the program, run its "
    "tests, replace the defective line with a corrected one, run the tests again, and call "
    "submit when they pass. Make the smallest change that fixes the defect."
)

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Show a file of the repository with line numbers.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "e.g. python_programs/gcd.py"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the program's tests (pytest); shows the failures.",
        "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "replace_lines",
        "description": "Replace lines start..end (1-based, inclusive) of a program with new "
                       "text (one or more lines, indented as the code around them).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
            "start": {"type": "integer"},
            "end": {"type": "integer"},
            "text": {"type": "string"}},
            "required": ["path", "start", "end", "text"]}}},
    {"type": "function", "function": {
        "name": "submit",
        "description": "Submit the fix: the tests run one last time and the task ends.",
        "parameters": {"type": "object", "properties": {}}}},
]


def tasks_in(root):
    return sorted(f[5:-3] for f in os.listdir(os.path.join(root, "python_testcases"))
                  if f.startswith("test_") and f.endswith(".py"))


def make_task(root, name):
    """A scratch QuixBugs layout holding only `name` (never correct_python_programs/)."""
    d = tempfile.mkdtemp(prefix=f"quixbugs-{name}-")
    for sub in ("python_programs", "python_testcases", "json_testcases"):
        os.makedirs(os.path.join(d, sub))
    shutil.copy(os.path.join(root, "conftest.py"), d)
    for src, sub in ((f"{name}.py", "python_programs"), ("node.py", "python_programs"),
                     (f"test_{name}.py", "python_testcases"),
                     ("load_testdata.py", "python_testcases"), ("node.py", "python_testcases"),
                     (f"{name}.json", "json_testcases")):
        p = os.path.join(root, sub, src)
        if os.path.exists(p):
            shutil.copy(p, os.path.join(d, sub))
    return d


def trim(text, max_lines, max_chars):
    """Head and tail of long output, as a harness shows it."""
    lines = text.splitlines()
    if len(lines) > max_lines:
        half = max_lines // 2
        lines = lines[:half] + [f"... ({len(lines) - max_lines} lines cut) ..."] + lines[-half:]
    out = "\n".join(lines)
    if len(out) > max_chars:
        out = out[: max_chars // 2] + "\n... (cut) ...\n" + out[-max_chars // 2:]
    return out


class Workspace:
    def __init__(self, root, name, args):
        self.dir = make_task(root, name)
        self.name, self.args = name, args

    def path(self, p, write=False):
        if not isinstance(p, str) or not p or os.path.isabs(p) or ".." in p.split("/"):
            raise ValueError(f"path must be relative to the repository: {p!r}")
        full = os.path.join(self.dir, p)
        if write and not p.startswith("python_programs/"):
            raise ValueError("only files under python_programs/ may be edited")
        if not os.path.isfile(full):
            raise ValueError(f"no file {p}; the program is python_programs/{self.name}.py")
        return full

    def read_file(self, path):
        with open(self.path(path)) as f:
            lines = f.read().splitlines()
        return "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(lines)) or "(empty file)"

    def run_tests(self):
        """Returns (passed, trimmed output)."""
        cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider",
               "--maxfail=3",
               f"--timeout={self.args.test_timeout}", f"python_testcases/test_{self.name}.py"]
        try:
            r = subprocess.run(cmd, cwd=self.dir, capture_output=True, text=True,
                               timeout=self.args.tests_cap)
        except subprocess.TimeoutExpired:
            return False, f"the tests did not finish within {self.args.tests_cap} s"
        out = trim(r.stdout + r.stderr, self.args.output_lines, self.args.output_chars)
        return r.returncode == 0, out

    def replace_lines(self, path, start, end, text):
        full = self.path(path, write=True)
        with open(full) as f:
            lines = f.read().splitlines()
        if not (isinstance(start, int) and isinstance(end, int) and 1 <= start <= end <= len(lines)):
            raise ValueError(f"start and end must satisfy 1 <= start <= end <= {len(lines)}")
        new = text.splitlines() if isinstance(text, str) else None
        if new is None:
            raise ValueError("text must be a string")
        lines[start - 1: end] = new
        source = "\n".join(lines) + "\n"
        # As SWE-agent's edit guard does: an edit that breaks the syntax is refused, so one
        # bad edit cannot leave a program the model can no longer read its way back from.
        try:
            compile(source, path, "exec")
        except SyntaxError as e:
            raise ValueError(f"{EDIT_REFUSED}: it leaves a syntax error ({e.msg}, "
                             f"line {e.lineno}); the file is unchanged") from None
        with open(full, "w") as f:
            f.write(source)
        return f"replaced lines {start}-{end} with {len(new)} line(s)"

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def call_tool(ws, name, raw_args):
    """(tool result text, submitted, solved)."""
    try:
        a = json.loads(raw_args or "{}") if isinstance(raw_args, str) else (raw_args or {})
        if not isinstance(a, dict):
            raise ValueError("the arguments must be a JSON object")
        if name == "read_file":
            return ws.read_file(a.get("path")), False, False
        if name == "run_tests":
            ok, out = ws.run_tests()
            return ("All tests passed.\n" if ok else "") + out, False, False
        if name == "replace_lines":
            return ws.replace_lines(a.get("path"), a.get("start"), a.get("end"),
                                    a.get("text")), False, False
        if name == "submit":
            ok, out = ws.run_tests()
            return ("Submitted: all tests pass." if ok else "Submitted: tests fail.\n" + out), True, ok
        return f"Error: no tool {name!r}; the tools are {[t['function']['name'] for t in TOOLS]}", False, False
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        return f"Error: {e}", False, False


def turn_seed(seed, task, turn):
    """The sampler seed of one turn: a function of (seed, task, turn) and not of the arm, so
    the arms of a task draw the same random numbers (paired), while turns and tasks differ."""
    h = hashlib.sha256(f"{seed}/{task}/{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1  # a non-negative i64


def compatible(rec):
    """Whether a record of a run file was made under this harness configuration."""
    h = rec.get("harness", 1)
    return h == HARNESS or (rec.get("seed") == 0 and GREEDY_SAME_SINCE <= h <= HARNESS)


def transcript_file(arm, seed, task):
    """The name of a run's transcript in the --transcripts folder."""
    return f"{arm}-{seed}-{task}.json"


def read_runs(path):
    """The records of a run file (one JSON line per finished run), in the order they ran."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_task(client, args, arm, seed, name):
    spec = ARMS[arm]
    ws = Workspace(args.quixbugs, name, args)
    sid = f"quixbugs-{arm}-{seed}-{name}-{uuid.uuid4().hex[:8]}"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"The tests in python_testcases/test_{name}.py fail. Find "
                                    f"and fix the defective line of python_programs/{name}.py. "
                                    "Call one tool per reply; begin by reading the program."},
    ]
    rec = {"harness": HARNESS, "arm": arm, "seed": seed, "task": name, "solved": False,
           "end": "turn_limit",
           "turns": 0, "tool_calls": 0, "malformed": 0, "prompt_tokens": 0,
           "cached_tokens": 0, "prefilled_tokens": 0, "completion_tokens": 0}
    leyline = {"mode": "amortize" if spec["session"] else "prefix"}
    if spec["edits"]:
        leyline["context_management"] = {"edits": spec["edits"]}
    headers = {"X-Session-Id": sid} if spec["session"] else {}
    t0 = time.perf_counter()
    try:
        while rec["turns"] < args.max_turns:
            if time.perf_counter() - t0 > args.task_cap:
                rec["end"] = "wall_clock"
                break
            body = {"leyline": leyline}
            if seed == 0:
                kw = {"temperature": 0.0}
            else:
                # top_k is no argument of the openai client: it travels in the body.
                kw = {k: v for k, v in SAMPLING.items() if k != "top_k"}
                kw["seed"] = turn_seed(seed, name, rec["turns"])
                body["top_k"] = SAMPLING["top_k"]
            try:
                r = client.chat.completions.create(
                    model=args.model, messages=messages, tools=TOOLS,
                    max_tokens=args.max_tokens, extra_headers=headers,
                    extra_body=body, **kw)
            except Exception as e:  # the openai client's 400 for a prompt over the context
                if "context" in str(e).lower() and getattr(e, "status_code", None) == 400:
                    rec["end"] = "context_limit"
                    break
                raise
            rec["turns"] += 1
            u = r.usage
            rec["prompt_tokens"] += u.prompt_tokens
            rec["completion_tokens"] += u.completion_tokens
            rec["cached_tokens"] += (u.prompt_tokens_details.cached_tokens
                                     if u.prompt_tokens_details else 0) or 0
            rec["prefilled_tokens"] += (r.model_extra.get("leyline") or {}).get(
                "tokens_prefilled", 0)
            msg = r.choices[0].message
            calls = msg.tool_calls or []
            if not calls:
                rec["malformed"] += 1
                messages.append({"role": "assistant", "content": msg.content or ""})
                text = msg.content or ""
                why = ("could not be parsed" if "<tool_call>" in text or '"name"' in text
                       else "is missing")
                messages.append({"role": "user", "content":
                                 f"Error: the tool call {why}. Reply with exactly one call of "
                                 "read_file, run_tests, replace_lines or submit, in the "
                                 "<tool_call> format with JSON arguments."})
                continue
            messages.append({"role": "assistant", "content": msg.content or "",
                             "tool_calls": [c.model_dump() for c in calls]})
            done = False
            for c in calls:
                rec["tool_calls"] += 1
                out, submitted, solved = call_tool(ws, c.function.name, c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "name": c.function.name,
                                 "content": out})
                if submitted:
                    rec["solved"], rec["end"], done = solved, "submit", True
                    break
            if done:
                break
    finally:
        ws.close()
        if spec["session"]:
            try:
                client.delete(f"/sessions/{sid}", cast_to=object)
            except Exception:
                pass
    rec["wall_s"] = time.perf_counter() - t0
    if args.transcripts:
        os.makedirs(args.transcripts, exist_ok=True)
        with open(os.path.join(args.transcripts, transcript_file(arm, seed, name)), "w") as f:
            json.dump({"record": rec, "messages": messages}, f, indent=1)
    return rec


def run(args):
    from openai import APIConnectionError, OpenAI  # the official client, as a harness uses it

    # SIGTERM as an exit, so the running task's `finally` removes its scratch copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "unused",
                    max_retries=1, timeout=args.task_cap)
    done = set()
    for r in read_runs(args.out) if os.path.exists(args.out) else []:
        if not compatible(r):
            sys.exit(f"{args.out} holds runs of harness configuration "
                     f"{r.get('harness', 1)}, this is {HARNESS}; use another --out")
        done.add((r["arm"], r["seed"], r["task"]))
    names = args.tasks.split(",") if args.tasks else tasks_in(args.quixbugs)
    unknown = sorted(set(names) - set(tasks_in(args.quixbugs)))
    if unknown:
        sys.exit(f"unknown tasks: {unknown}")
    # Arms alternate within a task, so a partial run holds paired results.
    todo = [(a, s, t) for s in args.seeds for t in names for a in args.arms
            if (a, s, t) not in done]
    print(f"{len(done)} done, {len(todo)} to run", file=sys.stderr)
    for i, (arm, seed, name) in enumerate(todo):
        try:
            rec = run_task(client, args, arm, seed, name)
        except APIConnectionError:
            sys.exit(f"cannot reach the server at {args.url} (start `leyline serve --model "
                     f"{args.model}` first); {len(done) + i} runs are in {args.out}, "
                     "run again to resume")
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{i + 1}/{len(todo)}] {arm} seed {seed} {name}: "
              f"{'solved' if rec['solved'] else rec['end']} in {rec['turns']} turns, "
              f"{rec['wall_s']:.0f} s", file=sys.stderr, flush=True)


def wilson(k, n, z=1.96):
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # Clamped: at k = 0 or k = n rounding can put the bound a hair outside [0, 1] (printed -0.0).
    return max(0.0, c - h), min(1.0, c + h)


def mcnemar(b, c):
    """Exact two-sided p of McNemar's test on the discordant counts."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def report(args):
    recs = read_runs(args.out)
    if not recs:
        sys.exit(f"{args.out} has no records")
    arms = [a for a in ARMS if any(r["arm"] == a for r in recs)]
    by = {(r["arm"], r["seed"], r["task"]): r for r in recs}
    print("| arm | runs | solved | solve rate (95% CI) | turns / run | tool calls / run | "
          "malformed / run | prompt tokens / run | prefilled / run | prefilled / solved | "
          "cache hit | wall s / run | wall s / solved |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = {"arms": {}, "pairs": []}
    for a in arms:
        rs = [r for r in recs if r["arm"] == a]
        n, k = len(rs), sum(r["solved"] for r in rs)
        lo, hi = wilson(k, n)
        tot = lambda key: sum(r[key] for r in rs)  # noqa: E731
        row = {"runs": n, "solved": k, "rate": k / n, "ci": [lo, hi],
               "turns": tot("turns") / n, "tool_calls": tot("tool_calls") / n,
               "malformed": tot("malformed") / n, "prompt_tokens": tot("prompt_tokens") / n,
               "prefilled": tot("prefilled_tokens") / n,
               "prefilled_per_solved": tot("prefilled_tokens") / k if k else None,
               "cache_hit": tot("cached_tokens") / max(1, tot("prompt_tokens")),
               "wall_s": tot("wall_s") / n, "wall_per_solved": tot("wall_s") / k if k else None}
        out["arms"][a] = row
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"| {a} | {n} | {k} | {100 * row['rate']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) "
              f"| {row['turns']:.1f} | {row['tool_calls']:.1f} | {row['malformed']:.1f} "
              f"| {row['prompt_tokens']:.0f} | {row['prefilled']:.0f} "
              f"| {fmt(row['prefilled_per_solved'], '.0f')} | {row['cache_hit']:.3f} "
              f"| {row['wall_s']:.0f} | {fmt(row['wall_per_solved'], '.0f')} |")
    print()
    rng = random.Random(20261202)
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            keys = sorted({(s, t) for (x, s, t) in by if x == a} & {(s, t) for (x, s, t) in by if x == b})
            if not keys:
                continue
            da = {k: by[(a, *k)]["solved"] for k in keys}
            db = {k: by[(b, *k)]["solved"] for k in keys}
            only_a = [k for k in keys if da[k] and not db[k]]
            only_b = [k for k in keys if db[k] and not da[k]]
            diff = (len(only_b) - len(only_a)) / len(keys)
            # Bootstrap over tasks (each task's runs of every seed together).
            tasks = sorted({t for _, t in keys})
            per = {t: [(db[k] - da[k]) for k in keys if k[1] == t] for t in tasks}
            boots = []
            for _ in range(10000):
                pick = [per[rng.choice(tasks)] for _ in tasks]
                xs = [x for p in pick for x in p]
                boots.append(sum(xs) / len(xs))
            boots.sort()
            lo, hi = boots[249], boots[9749]
            p = mcnemar(len(only_a), len(only_b))
            noise = "within noise" if lo <= 0 <= hi else "outside noise"
            print(f"- {b} vs {a}: {100 * diff:+.1f} points over {len(keys)} paired runs "
                  f"(95% bootstrap over tasks {100 * lo:+.1f} to {100 * hi:+.1f}; McNemar "
                  f"p = {p:.3f}; {noise}); solved only by {b}: "
                  f"{sorted(f'{t}@{s}' for s, t in only_b) or 'none'}; only by {a}: "
                  f"{sorted(f'{t}@{s}' for s, t in only_a) or 'none'}")
            out["pairs"].append({"a": a, "b": b, "paired": len(keys), "diff": diff,
                                 "ci": [lo, hi], "mcnemar_p": p,
                                 "only_a": len(only_a), "only_b": len(only_b)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def transcript_figures(transcripts):
    """What the model did in a list of transcripts ({"record", "messages"} as `run` writes
    them): turns, tool calls by name, edits refused for a syntax error, empty replies, replies
    without a call that repeat the text of the reply before, and submits (wrong or right)."""
    fig = {"runs": len(transcripts), "turns": 0, "tool_calls": {}, "edits_refused": 0,
           "empty": 0, "prose": 0, "repeats": 0, "submits": 0, "solved": 0}
    for t in transcripts:
        prev = None
        for m in t["messages"]:
            if m["role"] == "tool":
                if m.get("name") == "replace_lines" and m["content"].startswith(
                        f"Error: {EDIT_REFUSED}"):
                    fig["edits_refused"] += 1
                continue
            if m["role"] != "assistant":
                continue
            fig["turns"] += 1
            calls = [(c["function"]["name"], c["function"]["arguments"])
                     for c in m.get("tool_calls") or []]
            text = (m.get("content") or "").strip()
            for name, _ in calls:
                fig["tool_calls"][name] = fig["tool_calls"].get(name, 0) + 1
            if not calls:
                if not text:
                    fig["empty"] += 1
                else:
                    fig["prose"] += 1
                    if prev == ("", text):
                        fig["repeats"] += 1
            prev = ("call" if calls else "", text)
        rec = t["record"]
        if rec["end"] == "submit":
            fig["submits"] += 1
            fig["solved"] += bool(rec["solved"])
    return fig


def transcripts(args):
    recs = read_runs(args.out)
    first, last = 1, len(recs)
    if args.runs:
        try:
            first, last = (int(x) for x in args.runs.split("-"))
        except ValueError:
            sys.exit(f"--runs takes FIRST-LAST (1-based lines of {args.out}), not {args.runs!r}")
        if not 1 <= first <= last <= len(recs):
            sys.exit(f"--runs {args.runs}: {args.out} holds runs 1-{len(recs)}")
    loaded, missing = [], []
    for r in recs[first - 1:last]:
        path = os.path.join(args.dir, transcript_file(r["arm"], r["seed"], r["task"]))
        if not os.path.exists(path):
            missing.append(os.path.basename(path))
            continue
        with open(path) as f:
            loaded.append(json.load(f))
    if missing:
        sys.exit(f"{len(missing)} of runs {first}-{last} have no transcript in {args.dir}: "
                 f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    fig = transcript_figures(loaded)
    calls = fig["tool_calls"]
    edits = calls.get("replace_lines", 0)
    print(f"runs {first}-{last}: {sum(calls.values())} tool calls in {fig['turns']} turns "
          f"({calls.get('read_file', 0)} reads, {edits} edits of which {fig['edits_refused']} "
          f"were refused for a syntax error, {calls.get('run_tests', 0)} test runs, "
          f"{fig['submits']} submit(s), {fig['solved']} solved), {fig['empty']} empty "
          f"replies, {fig['prose']} replies of text without a call of which {fig['repeats']} "
          "repeat the reply before verbatim")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the tasks of every arm and seed (resumable)")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="the leyline server")
    r.add_argument("--api-key", default=os.environ.get("LEYLINE_API_KEY"))
    r.add_argument("--model", default="qwen2.5-coder-1.5b")
    r.add_argument("--quixbugs", default=None,
                   help="the QuixBugs folder (default: the repository's data/quixbugs)")
    r.add_argument("--tasks", help="comma-separated task names (default: all 40)")
    r.add_argument("--arms", type=lambda s: s.split(","),
                   default=["none", "truncate", "truncate_reprefill"],
                   help=f"comma-separated, of {list(ARMS)}")
    r.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2],
                   help="0 is greedy; others sample ("
                        + ", ".join(f"{k} {v}" for k, v in SAMPLING.items())
                        + ") with per-turn seeds derived from that seed")
    r.add_argument("--max-turns", type=int, default=20)
    r.add_argument("--max-tokens", type=int, default=256,
                   help="per reply (a tool call takes under 100)")
    r.add_argument("--task-cap", type=float, default=900.0, help="wall-clock seconds per task")
    r.add_argument("--test-timeout", type=float, default=10.0,
                   help="seconds per test (the correct levenshtein takes about 1 s)")
    r.add_argument("--tests-cap", type=float, default=60.0, help="seconds per test run")
    r.add_argument("--output-lines", type=int, default=40, help="test output kept, in lines")
    r.add_argument("--output-chars", type=int, default=3000, help="test output kept, in chars")
    r.add_argument("--out", required=True, help="JSON lines, one per finished task run")
    r.add_argument("--transcripts", help="write each task run's messages to this folder")
    p = sub.add_parser("report", help="compare the arms of a finished (or partial) run")
    p.add_argument("--out", required=True)
    p.add_argument("--json", help="write the figures here")
    t = sub.add_parser("transcripts", help="what the model did in the transcripts of some runs")
    t.add_argument("--out", required=True, help="the runs' JSON lines (as for report)")
    t.add_argument("--dir", required=True, help="the folder `run --transcripts` wrote")
    t.add_argument("--runs", help="FIRST-LAST, 1-based lines of --out (default: all)")
    t.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.cmd == "report":
        return report(args)
    if args.cmd == "transcripts":
        return transcripts(args)
    for a in args.arms:
        if a not in ARMS:
            sys.exit(f"unknown arm {a!r}; the arms are {list(ARMS)}")
    if args.quixbugs is None:
        args.quixbugs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                                     "quixbugs")
    if not os.path.isdir(os.path.join(args.quixbugs, "python_testcases")):
        sys.exit(f"no QuixBugs at {args.quixbugs}; pass --quixbugs")
    run(args)


if __name__ == "__main__":
    main()
