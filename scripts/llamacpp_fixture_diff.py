#!/usr/bin/env python3
"""How far llama.cpp's own logits are from the transformers fixtures Leyline is tested on.

Issue 59 fixes the logit tolerance of the reference tests at 1.5x llama.cpp's own max |logit
difference| on the same fixtures: this measures that side. For every fixture of
crates/leyline-model/tests/fixtures/{smollm2,qwen2.5-coder-0.5b}/logits, the fixture's token
ids are evaluated by llama.cpp (through llama-cpp-python, built from the same vendored
llama.cpp as scripts/side_by_side.sh, 2 threads, logits at every position) on the GGUF the
fixture names, and compared with the fixture's top-10 logits at every position.

    python3 scripts/llamacpp_fixture_diff.py [--json OUT]

Needs `import llama_cpp` (llama-cpp-python 0.3.36, built from source: pip install
--no-binary llama-cpp-python llama-cpp-python==0.3.36) and the models in ~/.cache/leyline
(`leyline model fetch smollm2-135m`, `... qwen2.5-coder-0.5b`).
"""

import argparse
import glob
import json
import os
import sys

import llama_cpp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "crates/leyline-model/tests/fixtures")
HOME = os.environ.get("LEYLINE_HOME", os.path.expanduser("~/.cache/leyline"))


def model_file(name):
    files = glob.glob(os.path.join(HOME, "models", name, "*.gguf"))
    if not files:
        sys.exit(f"{name}: no GGUF under {HOME}/models/{name}: run `leyline model fetch {name}`")
    return files[0]


# Fixture folder of each model.
FIXTURES = {"smollm2-135m": "smollm2", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b"}


def cases(model):
    """(name, ids, [[(id, logit)] * 10] per position) of each fixture of `model`."""
    paths = sorted(glob.glob(os.path.join(FIX, FIXTURES[model], "logits", "*.json")))
    if not paths:
        sys.exit(f"{model}: no fixtures under {FIX}/{FIXTURES[model]}/logits")
    for path in (p for p in paths if not p.endswith("index.json")):
        d = json.load(open(path))
        name = os.path.basename(path)[:-5]
        if "per_position" in d:  # SmolLM2's layout
            pp = d["per_position"]
            top = [list(zip(i, l)) for i, l in zip(pp["top10_ids"], pp["top10_logits"])]
            yield name, d["input_ids"], top
        else:  # Qwen's
            yield name, d["ids"], [[(p[0], p[1]) for p in row] for row in d["top10"]]


def measure(model):
    llm = llama_cpp.Llama(model_path=model_file(model), n_ctx=1024, n_threads=2,
                          n_batch=512, logits_all=True, verbose=False)
    out = {}
    for name, ids, top in cases(model):
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        worst = max(abs(scores[p][i] - want) for p, row in enumerate(top) for i, want in row)
        flips = sum(int(np.argmax(scores[p]) != row[0][0]) for p, row in enumerate(top))
        out[name] = {"positions": len(ids), "max_abs_diff": worst, "top1_differs": flips}
        print(f"{model} {name}: {len(ids)} positions, max |logit diff| over the top-10 "
              f"{worst:.4f}, top-1 differs at {flips}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    res = {m: measure(m) for m in ("smollm2-135m", "qwen2.5-coder-0.5b")}
    for m, r in res.items():
        print(f"{m}: llama.cpp's max |logit diff| over every fixture "
              f"{max(v['max_abs_diff'] for v in r.values()):.4f}")
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
