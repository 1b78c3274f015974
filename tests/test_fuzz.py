"""Seeded fuzzing of every header dcptool reads, through the real command line.

Small checkpoints of each format are mutated a few hundred ways (``SEED`` makes the corpus the same on
every run): DCP ``.metadata`` pickles and the zip records of ``.distcp`` files, safetensors headers,
``model.safetensors.index.json``, ``fsdp_config.json``, the pickles of FSDP1 per-rank files
(ShardedTensor and DTensor values) and a plain ``torch.save`` file. Mutations are byte-level (a
byte changed, a 4- or 8-byte field set to an extreme, a cut, a slice repeated or dropped),
opcode-aware for pickles (a memo index or length set to an extreme, an opcode replaced) and
data-aware for JSON (valid JSON of the wrong kind, 100,000-deep nesting, hostile shapes, offsets,
names and world sizes). Each mutant goes through ``inspect`` and ``convert``, every fourth also
through ``verify`` against itself, each run in its own process under a 2 GB address-space limit
and a 300 s alarm. Every run must exit 0 (the mutant still reads) or 2 with exactly one line on
stderr; never 1 (a mutant differs from itself), 3 (a bug), a signal, a traceback or a hang. On
exit 2 nothing may be left at the output path, and no mutant may be modified.

The runs (these and those of tests/test_hostile_inputs.py) are forked, two at a time, from one server
process that has dcptool imported once (``ForkServer`` of tests/jobs.py).
"""

from __future__ import annotations

import random

from fuzzing import CONVERT_TO, CORPUS, SEED, VERIFY_EVERY, check_run, digest, make_case


def test_fuzzed_headers_exit_0_or_2_with_one_line(bases, forked_runs, tmp_path):
    rng = random.Random(SEED)
    jobs, cases = [], []
    number = 0
    for kind, count in CORPUS.items():
        for _ in range(count):
            case_rng = random.Random(rng.getrandbits(64))
            folder = tmp_path / f"case{number:04d}-{kind}"
            path, fmt, what = make_case(kind, case_rng, bases, folder)
            cases.append((path, digest(path), f"case {number} ({kind}, {what})"))
            out_parent = tmp_path / f"out{number:04d}"
            out_parent.mkdir()
            out = out_parent / ("out.pt" if CONVERT_TO[fmt] == "torch" else "out")
            to = CONVERT_TO[fmt]
            commands = [["inspect", str(path)] + (["--json"] if number % 2 else []),
                        ["convert", str(path), str(out), "--to", to, "--no-fsync"]
                        + (["--world-size", "2"] if to == "fsdp1" else [])]
            if number % VERIFY_EVERY == 0:
                commands.append(["verify", str(path), str(path)])
            if number % VERIFY_EVERY == 2:  # check: 1 (its problems named) is as good an answer as 0 or 2
                commands.append(["check", str(path)] + (["--json"] if number % 8 == 2 else []))
            for argv in commands:
                jobs.append({"argv": ["--quiet", *argv], "out": str(out) if argv[0] == "convert" else None,
                             "case": cases[-1][2]})
            number += 1
    assert number == sum(CORPUS.values())

    results = forked_runs.run([job["argv"] for job in jobs])
    assert len(results) == len(jobs)
    problems = []
    for job, result in zip(jobs, results):
        problem = check_run(job, result)
        if problem:
            problems.append(f"{job['case']}: dcptool {' '.join(job['argv'][1:2])}: {problem}")
    for path, before, name in cases:
        if digest(path) != before:
            problems.append(f"{name}: the source was modified")
    refused = sum(1 for r in results if r.returncode == 2)
    assert not problems, f"{len(problems)} of {len(jobs)} runs went wrong:\n" + "\n".join(problems[:25])
    assert refused > len(jobs) // 4, "the corpus should break many checkpoints"  # it does bite
