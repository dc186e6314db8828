"""Static SASS instruction counts of a kernel's basic blocks (the speed proxy used without a GPU, issue 4).

Splits one function of `cuobjdump -sass` output into basic blocks (branch targets and the instruction after a
branch start a block) and prints every block of at least MIN instructions with its opcode histogram; the inner loops
of the EXL2 GEMVs are the large blocks that branch back to themselves or to their twin (ping-pong unrolled loops).

    python3 dev/kernels/sass_loops.py FILE.sass FUNCTION_REGEX [MIN=40]
(dev/kernels/gemv_sass.sh makes FILE.sass from cuda/exl2_gemm.cu.)
"""

import collections
import re
import sys


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0]


def main() -> int:
    path, pattern = sys.argv[1], sys.argv[2]
    min_size = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    ins, on = [], False
    for line in open(path):
        if "Function :" in line:
            on = re.search(pattern, line) is not None
            if on:
                print(line.strip())
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) if on else None
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    if not ins:
        print("no such function", file=sys.stderr)
        return 1
    leaders = {ins[0][0]}
    for i, (_, t) in enumerate(ins):
        op = opcode(t)
        target = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if (op.startswith("BRA") or op in ("EXIT", "RET", "BRX", "JMP", "CALL")) and i + 1 < len(ins):
            leaders.add(ins[i + 1][0])
        if target:
            leaders.add(int(target.group(1), 16))
    blocks, cur = [], []
    for a, t in ins:
        if a in leaders and cur:
            blocks.append(cur)
            cur = []
        cur.append((a, t))
    blocks.append(cur)
    total = collections.Counter(opcode(t) for _, t in ins if opcode(t) != "NOP")
    print(f"total {sum(total.values())} instructions")
    for b in blocks:
        c = collections.Counter(opcode(t) for _, t in b if opcode(t) != "NOP")
        n = sum(c.values())
        if n >= min_size:
            print(f"{b[0][0]:#07x} n={n:4d} ends: {b[-1][1][:48]}")
            print("         " + ", ".join(f"{k} {v}" for k, v in c.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
