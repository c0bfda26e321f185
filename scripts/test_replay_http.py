"""Tests of scripts/replay_http.py's `--recording` mode that need no server: edit-turn
detection, conversation naming, and the bodies and headers it sends.
Run: python3 -m unittest scripts/test_replay_http.py (crates/leyline-server/tests/record.rs does)."""

import copy
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_http as rh  # noqa: E402

SYNTHETIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates",
                         "leyline-server", "tests", "data", "recording-synthetic.jsonl")


def entry(seq, messages, conv="c1", path="/v1/messages", system="S", model="m"):
    return {"seq": seq, "path": path, "headers": {"X-Claude-Code-Session-Id": conv},
            "body": {"model": model, "system": system, "messages": copy.deepcopy(messages)}}


U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]}
R1 = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "long output"}]}
U2 = {"role": "user", "content": [{"type": "text", "text": "next"}]}


class EditTurns(unittest.TestCase):
    def test_a_growing_conversation_has_no_edit_turns(self):
        es = [entry(0, [U1]), entry(1, [U1, A1, R1]), entry(2, [U1, A1, R1, A1, U2])]
        self.assertEqual(rh.mark_edits(es), [None, False, False])

    def test_a_changed_earlier_message_is_an_edit_turn(self):
        cleared = copy.deepcopy(R1)
        cleared["content"][0]["content"] = "[cleared]"
        es = [entry(0, [U1, A1, R1]), entry(1, [U1, A1, cleared, A1, U2]), entry(2, [U1, A1, cleared, A1, U2, A1])]
        self.assertEqual(rh.mark_edits(es), [None, True, False])

    def test_a_changed_system_prompt_is_an_edit_turn(self):
        es = [entry(0, [U1]), entry(1, [U1, A1], system="other")]
        self.assertEqual(rh.mark_edits(es), [None, True])

    def test_moving_cache_markers_and_string_content_are_not_edits(self):
        marked = {"role": "user", "content": [{"type": "text", "text": "hi",
                                               "cache_control": {"type": "ephemeral"}}]}
        es = [entry(0, [marked]), entry(1, [U1, A1, R1])]
        self.assertEqual(rh.mark_edits(es), [None, False])

    def test_conversations_are_kept_apart_by_name_api_and_model(self):
        es = [entry(0, [U1, A1, R1]), entry(1, [U2], conv="c2"), entry(2, [U2], model="small"),
              entry(3, [U2], path="/v1/messages/count_tokens"), entry(4, [U1, A1, R1, A1])]
        self.assertEqual(rh.mark_edits(es), [None, None, None, None, False])
        # A request that names no conversation is never called an edit.
        anon = entry(5, [U2])
        anon["headers"] = {}
        self.assertEqual(rh.mark_edits([anon, anon]), [None, None])

    def test_responses_turns_by_prompt_cache_key(self):
        def resp(seq, items, instructions="I"):
            return {"seq": seq, "path": "/v1/responses", "headers": {},
                    "body": {"model": "m", "instructions": instructions, "input": items,
                             "prompt_cache_key": "k"}}
        a = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}
        b = {"type": "function_call_output", "call_id": "c", "output": "x"}
        b2 = dict(b, output="[cleared]")
        es = [resp(0, [a, b]), resp(1, [a, b, a]), resp(2, [a, b2, a, a]), resp(3, "just text")]
        self.assertEqual(rh.mark_edits(es), [None, False, True, True])

    def test_the_synthetic_recording_has_one_edit_turn_per_api(self):
        es = rh.load_recording(SYNTHETIC)
        edits = rh.mark_edits(es)
        apis = [rh.api_of(e["path"]) for e in es]
        self.assertEqual([a for a, ed in zip(apis, edits) if ed], ["messages"])
        self.assertGreaterEqual(apis.count("messages"), 6)
        self.assertGreaterEqual(apis.count("responses"), 4)
        self.assertTrue(all(e["body"].get("store") is False for e in es if rh.api_of(e["path"]) == "responses"))


class Requests(unittest.TestCase):
    def test_bodies_are_greedy_and_unstreamed_and_otherwise_as_recorded(self):
        rec = {"model": "claude-x", "stream": True, "max_tokens": 32000, "messages": [U1],
               "stream_options": {"include_usage": True}, "metadata": {"user_id": "u"}}
        b = rh.replay_body("messages", rec, model="smollm2", max_tokens=8)
        self.assertEqual((b["stream"], b["temperature"], b["max_tokens"], b["model"]),
                         (False, 0, 8, "smollm2"))
        self.assertNotIn("stream_options", b)
        self.assertEqual((b["messages"], b["metadata"]), (rec["messages"], rec["metadata"]))
        self.assertTrue(rec["stream"], "the recorded body is left as it was")
        r = rh.replay_body("responses", {"model": "x", "input": "q", "max_output_tokens": 4}, max_tokens=8)
        self.assertEqual((r["max_output_tokens"], r["model"]), (4, "x"))
        c = rh.replay_body("count_tokens", {"model": "x", "messages": [U1]})
        self.assertNotIn("temperature", c)
        self.assertNotIn("stream", c)

    def test_headers_carry_the_replays_key_only(self):
        h = rh.replay_headers({"X-Claude-Code-Session-Id": "c", "authorization": "Bearer old",
                               "x-leyline-mode": "amortize"}, api_key="new", header_mode="prefix")
        self.assertEqual(h, {"x-claude-code-session-id": "c", "content-type": "application/json",
                             "x-leyline-mode": "prefix", "authorization": "Bearer new"})


if __name__ == "__main__":
    unittest.main()
