"""Tests of scripts/policy_arm.py that need no model: the task layout, the tools, the
per-test timeout, solved detection, and the report's statistics against published values.
Run: python3 -m unittest scripts/test_policy_arm.py (crates/leyline/tests/policy_arm.rs does)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import policy_arm as pa  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "quixbugs")
ARGS = types.SimpleNamespace(test_timeout=1.0, tests_cap=20.0, output_lines=40, output_chars=3000)


class Workspace(unittest.TestCase):
    def test_a_task_holds_only_its_program_and_never_the_fix(self):
        ws = pa.Workspace(ROOT, "breadth_first_search", ARGS)
        try:
            files = sorted(os.path.relpath(os.path.join(d, f), ws.dir)
                           for d, _, fs in os.walk(ws.dir) for f in fs)
            self.assertIn("python_programs/breadth_first_search.py", files)
            self.assertIn("python_programs/node.py", files)
            self.assertIn("python_testcases/test_breadth_first_search.py", files)
            self.assertFalse(any("correct" in f for f in files), files)
            self.assertFalse(any("gcd" in f for f in files), files)
        finally:
            ws.close()
        self.assertEqual(len(pa.tasks_in(ROOT)), 40)

    def test_tools_read_edit_and_refuse_escapes(self):
        ws = pa.Workspace(ROOT, "gcd", ARGS)
        try:
            text = ws.read_file("python_programs/gcd.py")
            self.assertTrue(text.startswith("   1  def gcd(a, b):"), text[:40])
            out, submitted, solved = pa.call_tool(ws, "read_file", '{"path": "../etc/passwd"}')
            self.assertTrue(out.startswith("Error:") and not submitted, out)
            out, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(
                {"path": "python_testcases/test_gcd.py", "start": 1, "end": 1, "text": "x"}))
            self.assertIn("only files under python_programs/", out)
            out, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(
                {"path": "python_programs/gcd.py", "start": 5, "end": 99, "text": "x"}))
            self.assertTrue(out.startswith("Error:"), out)
            out, _, _ = pa.call_tool(ws, "no_such_tool", "{}")
            self.assertIn("no tool", out)
            out, _, _ = pa.call_tool(ws, "read_file", "{not json")
            self.assertTrue(out.startswith("Error:"), out)
            # The buggy program fails; the one-line fix passes at submit.
            out, submitted, solved = pa.call_tool(ws, "submit", "{}")
            self.assertTrue(submitted and not solved, out)
            out, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(
                {"path": "python_programs/gcd.py", "start": 5, "end": 5,
                 "text": "        return gcd(b, a % b)"}))
            self.assertIn("replaced lines 5-5", out)
            out, submitted, solved = pa.call_tool(ws, "submit", "{}")
            self.assertTrue(submitted and solved, out)
        finally:
            ws.close()

    def test_an_edit_that_breaks_the_syntax_is_refused(self):
        ws = pa.Workspace(ROOT, "gcd", ARGS)
        try:
            before = ws.read_file("python_programs/gcd.py")
            # The pilot's failure: a function's first lines replaced by indented body lines.
            out, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(
                {"path": "python_programs/gcd.py", "start": 1, "end": 2,
                 "text": "        return a"}))
            self.assertTrue(out.startswith("Error: the edit was not applied"), out)
            self.assertIn("line 1", out)
            self.assertEqual(ws.read_file("python_programs/gcd.py"), before)
        finally:
            ws.close()

    def test_a_run_file_of_another_harness_configuration_is_refused(self):
        d = tempfile.mkdtemp()
        try:
            out = os.path.join(d, "runs.jsonl")
            with open(out, "w") as f:  # a pilot record: no "harness" field
                f.write(json.dumps({"arm": "none", "seed": 0, "task": "gcd"}) + "\n")
            args = types.SimpleNamespace(url="http://127.0.0.1:9", api_key=None, task_cap=1.0,
                                         out=out, tasks="gcd", quixbugs=ROOT)
            with self.assertRaises(SystemExit) as e:
                pa.run(args)
            self.assertIn("harness configuration 1", str(e.exception))
        finally:
            shutil.rmtree(d)

    def test_greedy_runs_of_configuration_2_count_and_its_sampled_runs_do_not(self):
        self.assertTrue(pa.compatible({"harness": pa.HARNESS, "seed": 1}))
        self.assertTrue(pa.compatible({"harness": 2, "seed": 0}))
        self.assertFalse(pa.compatible({"harness": 2, "seed": 1}))
        self.assertFalse(pa.compatible({"seed": 0}))  # the pilot

    def test_each_turn_samples_with_its_own_seed_shared_by_the_arms(self):
        seeds = {pa.turn_seed(1, t, n) for t in ("gcd", "hanoi") for n in range(20)}
        self.assertEqual(len(seeds), 40)
        self.assertNotIn(pa.turn_seed(2, "gcd", 0), seeds)
        self.assertEqual(pa.turn_seed(1, "gcd", 3), pa.turn_seed(1, "gcd", 3))
        self.assertTrue(all(0 <= s < 2**63 for s in seeds))

    def test_a_server_that_is_not_there_is_named_and_the_run_resumable(self):
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()  # nothing listens there now
        tmp = tempfile.mkdtemp()
        try:
            p = subprocess.run(
                [sys.executable, os.path.abspath(pa.__file__), "run", "--model", "m",
                 "--url", f"http://127.0.0.1:{port}", "--quixbugs", ROOT, "--tasks", "gcd",
                 "--seeds", "0", "--out", os.path.join(tmp, "runs.jsonl")],
                env={**os.environ, "TMPDIR": tmp}, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn(f"cannot reach the server at http://127.0.0.1:{port}", p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertEqual([d for d in os.listdir(tmp) if d.startswith("quixbugs-")], [])
        finally:
            shutil.rmtree(tmp)

    def test_a_sampled_turn_sends_the_sampling_settings_and_its_own_seed(self):
        import http.server
        import threading
        bodies = []

        class Fake(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                call = {"id": "c1", "type": "function",
                        "function": {"name": "submit", "arguments": "{}"}}
                out = json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                        "role": "assistant", "content": None, "tool_calls": [call]}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *_):
                pass

        srv = http.server.HTTPServer(("127.0.0.1", 0), Fake)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        tmp = tempfile.mkdtemp()
        try:
            args = types.SimpleNamespace(
                **{**vars(ARGS), "url": f"http://127.0.0.1:{srv.server_port}", "api_key": None,
                   "task_cap": 60.0, "out": os.path.join(tmp, "runs.jsonl"), "tasks": "gcd",
                   "quixbugs": ROOT, "model": "m", "arms": ["none"], "seeds": [1],
                   "max_turns": 3, "max_tokens": 8, "transcripts": None})
            pa.run(args)
        finally:
            srv.shutdown()
            shutil.rmtree(tmp)
        self.assertEqual(len(bodies), 1)
        b = bodies[0]
        self.assertEqual((b["temperature"], b["top_p"], b["top_k"]), (0.7, 0.8, 20))
        self.assertEqual(b["seed"], pa.turn_seed(1, "gcd", 0))
        self.assertNotEqual(b["seed"], 1)

    def test_a_runner_stopped_by_sigterm_removes_its_scratch_task(self):
        # A server that takes the connection and never answers holds the runner mid-task.
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        tmp = tempfile.mkdtemp()
        try:
            p = subprocess.Popen(
                [sys.executable, os.path.abspath(pa.__file__), "run", "--model", "m",
                 "--url", f"http://127.0.0.1:{srv.getsockname()[1]}", "--quixbugs", ROOT,
                 "--tasks", "gcd", "--seeds", "0", "--out", os.path.join(tmp, "runs.jsonl")],
                env={**os.environ, "TMPDIR": tmp},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            scratch = []
            for _ in range(300):
                scratch = [d for d in os.listdir(tmp) if d.startswith("quixbugs-")]
                if scratch:
                    break
                time.sleep(0.05)
            self.assertTrue(scratch, "the runner never made its scratch task")
            time.sleep(0.5)
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(timeout=30), 143)
            self.assertEqual([d for d in os.listdir(tmp) if d.startswith("quixbugs-")], [])
        finally:
            srv.close()
            shutil.rmtree(tmp)

    def test_a_program_that_loops_forever_is_cut_by_the_timeouts(self):
        ws = pa.Workspace(ROOT, "bitcount", ARGS)
        try:
            ok, out = ws.run_tests()
            self.assertFalse(ok)
            self.assertIn("Timeout", out)
            self.assertLessEqual(len(out), ARGS.output_chars + 40)
        finally:
            ws.close()

    def test_every_task_is_solvable_with_the_correct_program(self):
        # Checks the layout: each task's tests pass once the correct program is in place (the
        # harness's default per-test timeout: the correct levenshtein takes about 1 s).
        slow = types.SimpleNamespace(**{**vars(ARGS), "test_timeout": 10.0, "tests_cap": 60.0})
        for name in pa.tasks_in(ROOT):
            ws = pa.Workspace(ROOT, name, slow)
            try:
                shutil.copy(os.path.join(ROOT, "correct_python_programs", f"{name}.py"),
                            os.path.join(ws.dir, "python_programs", f"{name}.py"))
                ok, out = ws.run_tests()
                self.assertTrue(ok, f"{name}: {out}")
            finally:
                ws.close()


class Statistics(unittest.TestCase):
    def test_wilson_interval_matches_published_values(self):
        # Newcombe (1998), Table I: 81/263 -> 0.2553 to 0.3662.
        lo, hi = pa.wilson(81, 263)
        self.assertAlmostEqual(lo, 0.2553, places=4)
        self.assertAlmostEqual(hi, 0.3662, places=4)

    def test_wilson_bounds_stay_in_the_unit_interval(self):
        for n in range(1, 60):
            for k in (0, n):
                lo, hi = pa.wilson(k, n)
                self.assertTrue(0.0 <= lo <= hi <= 1.0, (k, n, lo, hi))
                self.assertFalse(f"{lo * 100:.1f}".startswith("-"), (k, n, lo))

    def test_mcnemar_exact(self):
        # Two-sided exact binomial with 1 vs 6 discordant pairs: 2 * 8/128.
        self.assertAlmostEqual(pa.mcnemar(1, 6), 0.125)
        self.assertEqual(pa.mcnemar(0, 0), 1.0)
        self.assertEqual(pa.mcnemar(3, 3), 1.0)

    def test_report_reads_a_run_file(self):
        d = tempfile.mkdtemp()
        try:
            out = os.path.join(d, "run.jsonl")
            with open(out, "w") as f:
                for arm, solved in (("none", [1, 0, 0, 1]), ("truncate", [1, 1, 0, 1])):
                    for i, s in enumerate(solved):
                        f.write(json.dumps({
                            "arm": arm, "seed": 0, "task": f"t{i}", "solved": bool(s),
                            "end": "submit", "turns": 3, "tool_calls": 3, "malformed": 0,
                            "prompt_tokens": 100, "cached_tokens": 50, "prefilled_tokens": 50,
                            "completion_tokens": 10, "wall_s": 1.0}) + "\n")
            js = os.path.join(d, "report.json")
            pa.report(types.SimpleNamespace(out=out, json=js))
            with open(js) as f:
                r = json.load(f)
            self.assertEqual(r["arms"]["none"]["solved"], 2)
            self.assertEqual(r["arms"]["truncate"]["solved"], 3)
            pair = r["pairs"][0]
            self.assertEqual((pair["only_a"], pair["only_b"]), (0, 1))
            self.assertAlmostEqual(pair["diff"], 0.25)
        finally:
            shutil.rmtree(d)


def _call(name, args):
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


class Transcripts(unittest.TestCase):
    def transcript(self):
        # The refusal text comes from the harness's own tool, so a rewording shows here.
        ws = pa.Workspace(ROOT, "gcd", ARGS)
        try:
            bad = {"path": "python_programs/gcd.py", "start": 1, "end": 2, "text": "    return a"}
            refused, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(bad))
            good = {"path": "python_programs/gcd.py", "start": 5, "end": 5,
                    "text": "        return gcd(b, a % b)"}
            applied, _, _ = pa.call_tool(ws, "replace_lines", json.dumps(good))
        finally:
            ws.close()
        a = lambda text, *calls: {"role": "assistant", "content": text,  # noqa: E731
                                  **({"tool_calls": list(calls)} if calls else {})}
        tool = lambda name, text: {"role": "tool", "name": name, "content": text}  # noqa: E731
        user = {"role": "user", "content": "Error: the tool call is missing."}
        msgs = [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            a("", _call("read_file", {"path": "python_programs/gcd.py"})),  # turn 1
            tool("read_file", "1 def gcd"),
            a("Line 5 is wrong."), user,                                     # 2: prose
            a("Line 5 is wrong."), user,                                     # 3: repeat
            a("Line 5 is wrong."), user,                                     # 4: repeat
            a(""), user,                                                     # 5: empty
            a("Line 5 is wrong."), user,                                     # 6: after empty
            a("", _call("replace_lines", bad)), tool("replace_lines", refused),   # 7
            a("", _call("replace_lines", good)), tool("replace_lines", applied),  # 8
            a("", _call("run_tests", {})), tool("run_tests", "1 failed"),         # 9
            a("", _call("submit", {})), tool("submit", "Submitted: tests fail"),  # 10
        ]
        rec = {"arm": "none", "seed": 0, "task": "gcd", "solved": False, "end": "submit"}
        return {"record": rec, "messages": msgs}

    def test_figures_of_a_transcript_counted_by_hand(self):
        t = self.transcript()
        fig = pa.transcript_figures([t, t])
        self.assertEqual(fig["runs"], 2)
        self.assertEqual(fig["turns"], 20)
        self.assertEqual(fig["tool_calls"],
                         {"read_file": 2, "replace_lines": 4, "run_tests": 2, "submit": 2})
        self.assertEqual(fig["edits_refused"], 2)
        self.assertEqual((fig["empty"], fig["prose"], fig["repeats"]), (2, 8, 4))
        self.assertEqual((fig["submits"], fig["solved"]), (2, 0))

    def test_the_subcommand_picks_runs_by_line_and_names_missing_transcripts(self):
        d = tempfile.mkdtemp()
        try:
            out, tdir = os.path.join(d, "runs.jsonl"), os.path.join(d, "t")
            os.mkdir(tdir)
            t = self.transcript()
            with open(out, "w") as f:
                for task in ("a", "b", "c"):
                    f.write(json.dumps({**t["record"], "task": task}) + "\n")
            for task in ("b", "c"):
                # The documented on-disk name, not the helper: kept transcript folders rely on it.
                with open(os.path.join(tdir, f"none-0-{task}.json"), "w") as f:
                    json.dump({**t, "record": {**t["record"], "task": task}}, f)
            js = os.path.join(d, "fig.json")
            ns = lambda runs: types.SimpleNamespace(out=out, dir=tdir, runs=runs, json=js)  # noqa: E731
            pa.transcripts(ns("2-3"))
            with open(js) as f:
                self.assertEqual(json.load(f)["runs"], 2)
            with self.assertRaises(SystemExit) as e:
                pa.transcripts(ns(None))
            self.assertIn("none-0-a.json", str(e.exception.code))
            with self.assertRaises(SystemExit):
                pa.transcripts(ns("3-4"))
        finally:
            shutil.rmtree(d)


if __name__ == "__main__":
    unittest.main()
