"""Child CUDA graphs of kernel nodes, each node bound to a green context.

The operator's layer is a small DAG: two roots with no edge (dispatch in the communication context,
the grouped GEMM in the compute context) and a node that depends on both (finalize); SM90 adds a
fourth when shared experts are fused. Nodes carry `CUDA_KERNEL_NODE_PARAMS.kern` (the context-free
CUkernel) and `.ctx` (the green context's CUcontext), so the driver places each on its partition.
The graph is launched on its own or attached to an outer stream capture (torch CUDA graphs) as a
child-graph node, with the capture's dependencies updated. Graphs are cached by cubin hashes,
parameter signature and partition, so repeated layers and token counts replay the same graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .driver import check, cu
from .launch import LoadedKernel, ParamBuffer, _dim3, stream_handle


@dataclass
class KernelNode:
    name: str
    handle: Any
    kernel: LoadedKernel
    params: ParamBuffer
    context: Any
    grid: tuple[int, int, int]


class ChildGraph:
    """Build a DAG of kernel nodes; instantiate to launch it, or attach it to a capturing stream."""

    def __init__(self):
        self.graph = check(cu.cuGraphCreate(0), "cuGraphCreate")
        self.nodes: list[KernelNode] = []
        self._exec = None

    def add_kernel(self, name: str, kernel: LoadedKernel, grid, args: Sequence[Any], context,
                   depends_on: Sequence[KernelNode] = (), dynamic_smem: int | None = None) -> KernelNode:
        """Add a kernel node that runs in `context` (a green context's CUcontext) after `depends_on`."""
        if self._exec is not None:
            raise RuntimeError("the graph is already instantiated: build a new ChildGraph to change it")
        shape = kernel.entry.launch
        grid = _dim3(grid, "grid")
        if any(g % c for g, c in zip(grid, shape.cluster)):
            raise ValueError(f"{kernel.name}: grid {grid} is not a multiple of the cluster {shape.cluster}")
        smem = shape.dynamic_smem_bytes if dynamic_smem is None else int(dynamic_smem)
        params = kernel.pack(args)
        kernel.ensure_dynamic_smem(smem)
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.kern = kernel.kernel
        p.ctx = context
        p.gridDimX, p.gridDimY, p.gridDimZ = grid
        p.blockDimX, p.blockDimY, p.blockDimZ = shape.block
        p.sharedMemBytes = smem
        p.kernelParams = params.address
        deps = [n.handle for n in depends_on]
        handle = check(cu.cuGraphAddKernelNode(self.graph, deps, len(deps), p), f"cuGraphAddKernelNode({name})")
        if shape.cluster != (1, 1, 1):
            value = cu.CUkernelNodeAttrValue()
            value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = shape.cluster
            check(cu.cuGraphKernelNodeSetAttribute(
                handle, cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, value),
                f"cluster dimension of node {name}")
        node = KernelNode(name, handle, kernel, params, context, grid)
        self.nodes.append(node)
        return node

    def signature(self, partition_key: Any = None) -> str:
        """Cache key: every node's cubin hash, grid, argument bytes and dependencies, plus the partition."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(n.kernel.entry.cubin_sha256.encode())
            h.update(repr(n.grid).encode())
            h.update(n.params.signature)
        h.update(repr(partition_key).encode())
        return h.hexdigest()

    def instantiate(self):
        if self._exec is None:
            self._exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        return self._exec

    def launch(self, stream) -> None:
        check(cu.cuGraphLaunch(self.instantiate(), stream_handle(stream)), "cuGraphLaunch")

    def attach_to_capture(self, stream) -> Any:
        """Add this graph as a child node of the capture running on `stream`; later work depends on it."""
        handle = stream_handle(stream)
        info = check(cu.cuStreamGetCaptureInfo(handle), "cuStreamGetCaptureInfo")
        status = info[0]
        if status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("attach_to_capture needs a stream that is capturing (e.g. inside torch.cuda.graph)")
        capture_graph = next(v for v in info if isinstance(v, cu.CUgraph))
        deps = next((list(v) for v in info[3:] if isinstance(v, (list, tuple))), [])
        node = check(cu.cuGraphAddChildGraphNode(capture_graph, deps, len(deps), self.graph),
                     "cuGraphAddChildGraphNode")
        flags = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        check(cu.cuStreamUpdateCaptureDependencies(handle, [node], None, 1, flags),
              "cuStreamUpdateCaptureDependencies")
        return node

    def destroy(self) -> None:
        if self._exec is not None:
            check(cu.cuGraphExecDestroy(self._exec), "cuGraphExecDestroy")
            self._exec = None
        check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")


def graph_key(nodes: Sequence[tuple[LoadedKernel, Any, Sequence[Any]]], partition_key: Any = None) -> str:
    """Cache key of a graph before it is built: each node's cubin hash, grid and argument bytes, plus the
    partition (e.g. `GreenPartitions.describe()`), so equal layers and token counts share one graph."""
    from .launch import as_kernel_arg

    h = hashlib.sha256()
    for kernel, grid, args in nodes:
        h.update(kernel.entry.cubin_sha256.encode() + kernel.entry.entry_name.encode())
        h.update(repr(_dim3(grid, "grid")).encode())
        h.update(b"".join(as_kernel_arg(a).data for a in args))
    h.update(repr(partition_key).encode())
    return h.hexdigest()


class GraphCache:
    """Graphs by signature (cubin hashes, parameter bytes, partition): build once, replay after."""

    def __init__(self):
        self._graphs: dict[str, ChildGraph] = {}

    def get_or_build(self, key: str, build) -> ChildGraph:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = build()
        return graph

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        for g in self._graphs.values():
            g.destroy()
        self._graphs.clear()
