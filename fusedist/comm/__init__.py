"""The communication layer: a Communicator per group (symmetric memory, its NCCL
communicators, the call checks), the symmetric buffers' host side and protocol mirror
(symmetric.py, the layout.h mirror), NCCL through nccl4py or torch.distributed (nccl.py), and
the comm streams (streams.py). It builds on fusedist.distributed (who and where) and is used
by fusedist.ops."""
