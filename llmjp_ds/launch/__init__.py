"""Launching a job: where a process stands in it, its hosts, its rendezvous, and how it ends when a rank fails.

* :mod:`.scheduler`: this process's place (rank, world, master) from torchrun, the deepspeed launcher, Slurm,
  Open MPI or by hand;
* :mod:`.hostlist`: Slurm's compressed host and task lists, expanded (pure);
* :mod:`.hostfile`: a DeepSpeed hostfile written from a scheduler's allocation;
* :mod:`.hosts`: a hostfile read by the launcher's rule, and its hosts checked as the launcher will reach them;
* :mod:`.rendezvous`: the job's rendezvous, bounded in time, and the heartbeats that notice a silent host;
* :mod:`.launcher`: the process that launched this rank, noticed when it is gone;
* :mod:`.failure`: every rank ending, in seconds, when one fails or stalls, the cause printed once.
"""
