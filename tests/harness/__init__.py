"""The test harness: real training jobs that save the checkpoints the tests read, the models they build
(which scripts/bench.py builds too), and the oracles that check dcptool's output.

The jobs run under torchrun from the repository root, with the tests folder on the path (tests/jobs.py
starts them so)::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m harness.gloo_jobs save-dcp /tmp/ckpt --dp 2 --tp 2

Modules:
  models           the models: a tiny transformers Llama, a Llama of parameters only under the same
                   names, a torchtitan-style MoE; the optimizer and the training step
  parallel         meshes as torchtitan lays them out; TP, EP and FSDP2 / HSDP of those models
  states           state dicts as trainers hand them to DCP; comparison with a full reference
  runtime          joining a gloo job, printing from rank 0, timing, leaving without teardown
  gloo_jobs        the command line of save-dcp, load-dcp (dcp_jobs), save-fsdp1, load-fsdp1
                   (fsdp1_jobs), several joined by --then into one job
  family_models    tiny models of every adapter kind and an oracle of the naming families
  family_jobs      FSDP2 + EP jobs that save and load checkpoints in Archon or torchtitan names
  verl_jobs        verl's FSDP1 / FSDP2 save and resume, and a reference step in one process
  accelerate_jobs  an HF Trainer / accelerate checkpoint-N folder
  transformers_jobs  any transformers model trained and saved, or loaded, by transformers' own distributed
                   code (FSDP2, TP and EP by the model's plans)
  storage_jobs     torch's HF-storage and zstd DCP writers and readers
  synth_dcp        synthetic DCP checkpoints of N ranks, written by one process (no torchrun)
  megatron         megatron-core's GPTModel saved as Megatron-LM saves it (torch_dist or per-rank torch
                   files, run layout) and loaded back by its dist_checkpointing.load
"""
