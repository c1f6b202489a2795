"""Static SASS instruction counts of one step of a kernel's main loop, by class (no GPU needed).

The loop is the cycle of basic blocks through the block holding its wait instruction (default the
cp.async ring wait of moe_small's gate_up, ``DEPBAR.LE SB0, 0x3``), kept off CTA barriers (the outer
loops go through them); BRA.DIV's divergent fallback is taken as converged. A step is a path from that
block back to it; paths are grouped by their global loads (LDG) and async copies (LDGSTS), so a step of
one column tile and refill copies shows apart from one without copies or of two column tiles, and per
group the longest path is counted. Every block holding the wait is a loop of its own (a kernel may have
one step loop per template instance). Benchmarks' per-step figures (benchmarks/README.md) come from:

    python tools/sass_steps.py moe_small moe_small_gate_up_t2 --arch sm_90a
    python tools/sass_steps.py --sass dump.sass moe_small_gate_up_t2     # a saved `kernels dump --sass`
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_PRED = re.compile(r"^@!?U?P\w+\s+")
_LABEL = re.compile(r"`\((\.L_x_\d+)\)")


def parse(text: str, entry: str) -> tuple[list[str], dict[str, int]]:
    """The instructions of ``entry`` in nvdisasm text (without the trailing ';') and its labels' indices."""
    head = f"//--------------------- .text.{entry} "
    if head not in text:
        raise ValueError(f"entry {entry!r} not in the SASS")
    start = text.index(head)
    end = text.find("//--------------------- .text.", start + len(head))
    ins, labels = [], {}
    for line in text[start:end if end > 0 else None].splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1).strip())
    return ins, labels


def opcode(ins: str) -> str:
    return _PRED.sub("", ins).split()[0]


def klass(ins: str) -> str:
    """The class a step's instruction is counted under."""
    op = opcode(ins)
    base = op.split(".")[0]
    if base == "LOP3":
        return {"0xf000f": "LOP3 unpack", "0xffff0000": "LOP3 scale"}.get(
            next((k for k in ("0xf000f", "0xffff0000") if k in ins), ""), "LOP3 other")
    if base == "IMAD" and "0x10000" in ins:
        return "IMAD scale"
    if base == "IMAD" and ".MOV" in op or base == "MOV":
        return "MOV"
    if base in ("IMAD", "IADD3", "LEA", "VIADD", "SEL", "IADD"):
        return "int address"
    if base in ("UMOV", "USHF", "ULOP3", "R2UR", "UIADD3", "ULDC", "S2UR", "UISETP", "USEL", "UIMAD", "ULEA"):
        return "uniform"
    if base == "LDS" and ins.startswith("@!PT"):
        return "LDS never executed"
    return base


def blocks(ins: list[str], labels: dict[str, int]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Basic blocks [a, b) and their successors (block indices)."""
    leaders = {0, *labels.values()}
    for i, t in enumerate(ins):
        op = opcode(t).split(".")[0]
        if op in ("BRA", "EXIT", "RET"):
            leaders.add(i + 1)
            m = _LABEL.search(t)
            if op == "BRA" and m:
                leaders.add(labels[m.group(1)])
    starts = sorted(x for x in leaders if x < len(ins))
    spans = [(a, starts[k + 1] if k + 1 < len(starts) else len(ins)) for k, a in enumerate(starts)]
    index = {a: k for k, (a, _) in enumerate(spans)}
    succ = []
    for _, b in spans:
        last = ins[b - 1]
        op = opcode(last)
        # predicated: an @P guard, or a predicate operand (sm_100's BRA.U !UP0, ...)
        cond = bool(_PRED.match(last)) or bool(re.match(r"^BRA\S*\s+!?U?P\d", _PRED.sub("", last)))
        nxt = []
        if op.startswith("BRA.DIV"):
            nxt.append(b)
        elif op.startswith("BRA"):
            nxt.append(labels[_LABEL.search(last).group(1)])
            if cond:
                nxt.append(b)
        elif op.split(".")[0] in ("EXIT", "RET"):
            if cond:
                nxt.append(b)
        else:
            nxt.append(b)
        succ.append([index[x] for x in nxt if x in index])
    return spans, succ


def step_paths(ins: list[str], labels: dict[str, int], wait: str) -> list[dict[tuple[int, int], list[int]]]:
    """Per loop (block holding ``wait``): {(LDG count, LDGSTS count): the longest path's blocks}."""
    spans, succ = blocks(ins, labels)
    barrier = {k for k, (a, b) in enumerate(spans) if any(opcode(ins[i]).startswith("BAR") for i in range(a, b))}
    pred = collections.defaultdict(list)
    for k, ss in enumerate(succ):
        for s in ss:
            pred[s].append(k)

    def reach(h, edges):
        seen, todo = {h}, [h]
        while todo:
            for s in edges(todo.pop()):
                if s not in seen and s not in barrier:
                    seen.add(s)
                    todo.append(s)
        return seen

    def count(k, what):
        return sum(1 for i in range(*spans[k]) if opcode(ins[i]).startswith(what))

    heads = [k for k, (a, b) in enumerate(spans) if any(wait in ins[i] for i in range(a, b))]
    return [_longest(h, reach(h, lambda k: succ[k]) & reach(h, lambda k: pred[k]), spans, succ, count) for h in heads]


def _longest(h, loop, spans, succ, count) -> dict[tuple[int, int], list[int]]:
    """{(LDG, LDGSTS): the longest path's blocks} from loop head h's top back to it (the loop less its
    back edges is acyclic)."""
    memo: dict[int, dict] = {}

    def walk(k):
        if k not in memo:
            here, n, best = (count(k, "LDG."), count(k, "LDGSTS")), spans[k][1] - spans[k][0], {}
            for s in succ[k]:
                if s not in loop:
                    continue
                for (ldg, cp), (m, p) in ({(0, 0): (0, [])} if s == h else walk(s)).items():
                    key = (ldg + here[0], cp + here[1])
                    if key not in best or best[key][0] < m + n:
                        best[key] = (m + n, [k] + p)
            memo[k] = best
        return memo[k]

    return {key: p for key, (_, p) in walk(h).items()}


def report(text: str, entry: str, wait: str) -> str:
    ins, labels = parse(text, entry)
    spans, _ = blocks(ins, labels)
    lines = []
    for j, paths in enumerate(step_paths(ins, labels, wait)):
        lines.append(f"{entry}, loop {j} (block holding {wait!r}):")
        for (ldg, cp), path in sorted(paths.items()):
            c = collections.Counter(klass(ins[i]) for k in path for i in range(*spans[k]))
            lines.append(f"  {sum(c.values())} instructions per step with {ldg} LDG, {cp} LDGSTS: "
                         + ", ".join(f"{k} {v}" for k, v in c.most_common()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+", help="FAMILY ENTRY (built here), or ENTRY with --sass")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--sass", help="a saved nvdisasm text instead of building the family")
    ap.add_argument("--wait", default="DEPBAR.LE SB0, 0x3", help="the instruction marking the loop's head")
    a = ap.parse_args(argv)
    if a.sass:
        text, entry = open(a.sass).read(), a.names[-1]
    else:
        from ddtree_rtc.kernels.registry import spec
        from ddtree_rtc.rtc import build
        from ddtree_rtc.rtc.disasm import sass

        family, entry = a.names
        text = sass(build(spec(family), a.arch).cubin)
    sys.stdout.write(report(text, entry, a.wait))
    return 0


if __name__ == "__main__":
    sys.exit(main())
