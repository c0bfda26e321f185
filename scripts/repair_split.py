#!/usr/bin/env python3
"""Chooses a repair rule and setting on one probe set and scores it on another.

Reads `leyline verify --repair ... --json` reports. Probes from the first `--select` trajectories
of the trace file (by order in the file) form the selection set; every other probe of that
report, and every probe of the `--score` reports (other trace files), forms the scoring set.
On the selection set the best setting is the one with the most agreement with FORGET (the exact
edited context) where FORGET's margin is at least 0.25, among those whose recomputed share is at
most `--max-share`, ties to the lower mean KL(FORGET || repaired). The scoring set then gets the
same figures for that setting and for the splice alone.

The recomputed share is aggregate: tokens recomputed downstream of the edit over FORGET's
(every downstream token), the replacement excluded from both; a deviation rule's one-layer
scan of the downstream tokens counts at its cost, (scan layers) / (model layers) per token,
read from the report's aggregate rows.

Only the standard library. Prints Markdown tables; `--json` writes the figures.
"""

import argparse
import json
import sys

MARGIN = 0.25


def load(path):
    with open(path) as f:
        return json.load(f)


def scan_cost(report):
    """Per-token cost of a deviation scan, solved from the report's aggregate rows."""
    probes = report["per_probe"]
    down = sum(p["downstream"] for p in probes)
    for row in report.get("repair") or []:
        if row["rule"] != "deviation" or row["repair"] == 0:
            continue
        reps = [r for p in probes for r in p["repairs"]
                if r["rule"] == "deviation" and r["repair"] == row["repair"]]
        scanned = sum(r["scanned"] for r in reps)
        if scanned:
            return (row["recomputed_share"] * down - sum(r["repaired"] for r in reps)) / scanned
    return 0.0


def figures(probes, rule, n):
    """Agreement and cost of one setting (`n == 0`: the splice alone) over `probes`, pairs of
    (probe, its report's scan cost)."""
    down = rec = 0.0
    kl, agree_full, decided_full, agree_forget, decided_forget = [], 0, 0, 0, 0
    for p, c in probes:
        down += p["downstream"]
        if n == 0:
            token, klf = p["amortize_token"], p["kl_forget"]
        else:
            r = next(r for r in p["repairs"] if r["rule"] == rule and r["repair"] == n)
            token, klf = r["token"], r["kl_forget"]
            rec += r["repaired"] + c * r["scanned"]
        kl.append(klf)
        if p["full_margin"] >= MARGIN:
            decided_full += 1
            agree_full += token == p["full_token"]
        if p["forget_margin"] >= MARGIN:
            decided_forget += 1
            agree_forget += token == p["forget_token"]
    return {
        "rule": rule if n else "none",
        "repair": n,
        "probes": len(probes),
        "recomputed_share": rec / down if down else 0.0,
        "agree_forget_margin": agree_forget,
        "forget_margin_probes": decided_forget,
        "agree_forget_share": agree_forget / decided_forget if decided_forget else float("nan"),
        "agree_full_margin": agree_full,
        "full_margin_probes": decided_full,
        "agree_full_share": agree_full / decided_full if decided_full else float("nan"),
        "kl_forget_mean": sum(kl) / len(kl) if kl else float("nan"),
    }


def settings(report):
    return sorted({(r["rule"], r["repair"]) for p in report["per_probe"] for r in p["repairs"]
                   if r["repair"] > 0})


def row(f):
    return (f"| {f['rule']} | {f['repair']} | {f['probes']} | {100 * f['recomputed_share']:.1f}% "
            f"| {f['agree_forget_margin']}/{f['forget_margin_probes']} "
            f"({100 * f['agree_forget_share']:.1f}%) "
            f"| {f['agree_full_margin']}/{f['full_margin_probes']} "
            f"({100 * f['agree_full_share']:.1f}%) | {f['kl_forget_mean']:.4f} |")


HEADER = ("| rule | tokens | probes | recomputed share | agree with FORGET (its margin >= 0.25) "
          "| agree with unedited (its margin >= 0.25) | mean KL(FORGET ‖ this) |\n"
          "|---|---|---|---|---|---|---|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="verify --json report whose probes are split")
    ap.add_argument("--traces", required=True, help="the trace file that report's probes came from")
    ap.add_argument("--select", type=int, default=100,
                    help="probes of the first N trajectories choose the setting")
    ap.add_argument("--score", nargs="*", default=[], help="more reports, scored only")
    ap.add_argument("--max-share", type=float, default=0.10)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    with open(args.traces) as f:
        order = [json.loads(line)["id"] for line in f if line.strip()]
    first = set(order[: args.select])
    main_report = load(args.report)
    cost = scan_cost(main_report)
    select, score = [], []
    for p in main_report["per_probe"]:
        traj = p["label"].rsplit("#", 1)[0]
        if traj not in order:
            sys.exit(f"probe {p['label']} is not from {args.traces}")
        (select if traj in first else score).append((p, cost))
    for path in args.score:
        r = load(path)
        c = scan_cost(r)
        score.extend((p, c) for p in r["per_probe"])
    if not select or not score:
        sys.exit(f"empty split: {len(select)} selection probes, {len(score)} scoring probes")

    cands = [figures(select, "none", 0)]
    cands += [figures(select, rule, n) for rule, n in settings(main_report)]
    ok = [f for f in cands if f["recomputed_share"] <= args.max_share]
    best = max(ok, key=lambda f: (f["agree_forget_margin"] / max(1, f["forget_margin_probes"]),
                                  -f["kl_forget_mean"]))
    scored = [figures(score, "none", 0)]
    if best["repair"]:
        scored.append(figures(score, best["rule"], best["repair"]))

    print(f"Selection set: {len(select)} probes (the first {args.select} trajectories of "
          f"{args.traces}); scan cost {cost:.4f} of a full recompute per token.\n")
    print(HEADER)
    for f in cands:
        print(row(f))
    print(f"\nChosen (share <= {100 * args.max_share:.0f}%): {best['rule']}:{best['repair']}\n")
    print(f"Scoring set: {len(score)} probes.\n")
    print(HEADER)
    for f in scored:
        print(row(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"selection": cands, "chosen": [best["rule"], best["repair"]],
                       "scoring": scored, "scan_cost": cost}, f, indent=1)


if __name__ == "__main__":
    main()
