"""Communication for the GEMM + collective ops: engines/ holds one unit per engine (a gate that
says why it cannot take a call, and a run path) and the dispatcher that picks one."""
