"""The bootstrap layer: who and where. The launcher's environment (launch_env), the node / GPU
topology (topology), the rank lists of the tensor-parallel groups (groups), and the runtime
that init() builds from them (runtime). Nothing here knows about communicators or ops."""
