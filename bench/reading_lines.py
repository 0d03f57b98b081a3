"""How many lines a reader takes in for each idea: its textbook core, prose
included, as README.md's "Reading the code" counts them, beside picotron's
and nanoGPT's where they have one.

    python bench/reading_lines.py            # the table, as README.md gives it

A core is a list of pieces of the project's files, each from the first line
that matches START to the line before the first (later) line that matches
STOP (None: the end of the file). The peers' figures are `wc -l` of their
files at the commits named below (picotron 59714b1, nanoGPT 3adf61e).
tests/test_docs.py holds README's figures to these, within TOLERANCE.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.10  # README's figures may lag an edit by this much

# idea: (pieces (file, START, STOP), the peer's figure and what it counts, or None)
CORES = {
    "one step": ([("train.py", r"^", None),                              # the loop, the step, AdamW
                  ("gpt.py", r"^# Config", r"^# Llama's options"),       # GPTConfig
                  ("gpt.py", r"^# Model", r"^def is_moe_layer"),         # embeddings, attention, MLP
                  ("gpt.py", r"^class Block", r"^def domino_blocks"),
                  ("gpt.py", r"^def init_weights", r"^# Generation")],   # init, GPT: forward, head
                 (666, "nanoGPT's model.py + train.py")),
    "tensor parallelism": ([("parallel.py", r"^# -+\n# Raw collectives", r"^# -+\n# Sequence-parallel"),
                            ("parallel.py", r"^# 2\. Tensor parallelism", r"^# =+\n# 3\."),
                            ("gpt.py", r"^def tensor_parallel_piece", r"^def init_weights")],
                           (378, "picotron's tensor_parallel.py + tp_communications.py")),
    "sequence parallelism": ([("parallel.py", r"^# -+\n# Sequence-parallel", r"^# =+\n# 2\."),
                              ("parallel.py", r"^# 3\. Sequence parallelism", r"^# =+\n# 4\.")], None),
    "Domino": ([("parallel.py", r"^# 4\. Domino", r"^# =+\n# 5\.")], None),
    "context parallelism (the ring)": ([("context.py", r"^", r"^# =+\n# 3\. All-to-all")],
                                       (248, "picotron's context_parallel.py + cp_communications.py")),
    "pipeline (1F1B, interleaved)": ([("pipeline.py", r"^", r"^# -+\n# 3b\."),
                                      ("pipeline.py", r"^# -+\n# 4\. The pipelined step", r"^# -+\n# 5\.")],
                                     (266, "picotron's pipeline_parallel.py + pp_communications.py")),
    "zero bubble (ZB-H1)": ([("pipeline.py", r"^# -+\n# 3b\.", r"^# -+\n# 4\.")], None),
    "mixture of experts": ([("gpt.py", r"^def is_moe_layer", r"^class Block")], None),
    "expert parallelism": ([("expert_parallel.py", r"^", None)], None),
}


def piece_lines(path: str, start: str, stop: str | None) -> int:
    text = open(os.path.join(ROOT, path)).read()
    first = re.search(start, text, re.M)
    if first is None:
        raise SystemExit(f"{path}: no line matches {start!r}: update bench/reading_lines.py's CORES")
    end = re.compile(stop, re.M).search(text, first.end()) if stop else None
    if stop and end is None:
        raise SystemExit(f"{path}: no line after {start!r} matches {stop!r}: update bench/reading_lines.py's CORES")
    return text[first.start():end.start() if end else len(text)].count("\n")


def counts() -> dict[str, int]:
    return {idea: sum(piece_lines(*piece) for piece in pieces) for idea, (pieces, _) in CORES.items()}


def main() -> None:
    print("| idea | lines to read | peer |")
    print("| --- | --- | --- |")
    for idea, n in counts().items():
        peer = CORES[idea][1]
        print(f"| {idea} | {n} | {f'{peer[0]} ({peer[1]})' if peer else ''} |")


if __name__ == "__main__":
    sys.exit(main())
