"""CuTe DSL kernels, one role per module, per arch (sm90/, sm103/); `registry` lists the variants a profile needs."""
