"""Every private name of torch (and of the standard library) that the simulator reads, replaces or overrides.

None of these is torch's API: a release may rename, move or drop any of them, and the simulator would then
fail in ways that say nothing about the cause.  They are listed here, one record each (the name, the
simulator's modules that touch it, how, and why), so that a torch upgrade has one list to check:

    python -m simulator.adapters.torch_private      # checks every name against the installed torch

:func:`check_private_names` raises naming each missing one; ``tests/test_torch_private.py`` runs it and also
scans the simulator's source (``ast``) for accesses of ``torch._…`` names, so that a new touch fails the
test until it is listed here.  The adapters are pinned to the torch releases of :data:`SUPPORTED_TORCH`
(:func:`check_torch_version`).

Not listed: CPython's documented ``sys._getframe``, ``sys._current_frames`` and ``os._exit``; the
simulator's own attributes reached through torch's objects (``c10d._world._local`` is
:class:`~simulator.adapters.torch_globals._PerRankWorld`'s); the public torch names the CUDA stand-in
replaces (:data:`simulator.standin.PATCHED_PUBLIC`).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
from typing import Any, NamedTuple, Sequence

import torch

from tensorplay.distributed.errors import DistRuntimeError, format_message

__all__ = ["PrivateName", "PRIVATE_NAMES", "SUPPORTED_TORCH", "check_torch_version", "check_private_names",
           "missing_private_names"]

#: torch releases the adapters are tested with (major.minor)
SUPPORTED_TORCH = ("2.13", "2.14")


def check_torch_version(version: str | None = None) -> None:
    """Raise a clear error when the installed torch is not one the adapter supports."""
    v = version or torch.__version__
    if ".".join(v.split("+")[0].split(".")[:2]) not in SUPPORTED_TORCH:
        raise DistRuntimeError(format_message(
            "torch_native", "this torch release is not supported by the torch.distributed adapter",
            values={"torch": v, "supported": list(SUPPORTED_TORCH)},
            fix="install a supported torch (e.g. pip install torch==2.13.0), or use tensorplay.distributed "
                "directly, which needs no adapter"))


class PrivateName(NamedTuple):
    """One private name the simulator depends on."""

    name: str  #: dotted: the module, then attributes (``torch.distributed.distributed_c10d._world``)
    users: str  #: the simulator's modules that touch it (relative to ``simulator.``)
    how: str  #: "reads" (or calls), "patches" (replaced while installed), "overrides", "subclasses"
    why: str
    #: checked in the module's source without importing it: an attribute set on instances, or a module that
    #: only imports inside its own test environment
    static: bool = False
    #: a library a program may use, not a dependency (checked when it is installed)
    optional: bool = False
    #: a binding only torch's CUDA builds have (checked where torch was built with CUDA)
    cuda_build: bool = False


_P = PrivateName
_C10D = "torch.distributed.distributed_c10d"
_PG = "torch.distributed.ProcessGroup"
_NATIVE = "adapters.torch_native, adapters.torch_globals"
_HOOKS = "torch.nn.modules.module"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # -- torch.distributed's process groups (adapters.torch_native and its parts) -----------------------------
    _P(f"{_C10D}._world", f"{_NATIVE}, adapters.process_group, adapters.threads, isolation.child", "patches",
       "c10d's process-wide bookkeeping (groups, names, ranks): one per rank thread while a world runs; a rank "
       "process puts torch's back; a thread a rank starts shares its rank's"),
    _P(f"{_C10D}._World", "adapters.torch_globals", "subclasses",
       "one rank's c10d tables: torch's keeps them in module globals that rank threads would share"),
    _P(f"{_C10D}._pg_names", "adapters.torch_native", "patches",
       "the group -> name table; a simulated group also keeps its name (destroy_process_group reads it after "
       "removing the record)"),
    _P(f"{_C10D}.ProcessGroupGloo._Options", "adapters.process_group, adapters.torch_globals", "reads",
       "the options a group built as ProcessGroupGloo(store, rank, size, ...) carries (pg.options._timeout), as "
       "torch's class keeps them"),
    _P("torch.distributed.Backend._plugins", "adapters.torch_globals", "reads",
       "which backends a program registered itself (register_backend): those stay the program's own on "
       "simulated ranks"),
    _P(f"{_C10D}._new_process_group_helper", _NATIVE, "patches",
       "torch's one place that builds a group's backend: on a simulated rank every backend is the simulator"),
    _P(f"{_C10D}._is_barrier_after_init", _NATIVE, "patches",
       "runs right after init_process_group wraps sys.excepthook: a rank thread puts the previous hook back"),
    _P("torch.distributed.checkpoint._async_process_executor._ProcessBasedAsyncCheckpointExecutor",
       "adapters.torch_tables", "patches", "DCP's process-based async save: one daemon per process, refused on "
       "thread ranks"),
    _P("torch.distributed._dist2", "adapters.torch_tables", "patches",
       "the experimental dist2 API's gloo factory (its _BACKENDS table): a simulated group, not a C++ one"),
    _P("torch.distributed.rendezvous._rendezvous_handlers", "adapters.torch_native, launch", "patches",
       "env://, tcp:// and file:// rendezvous: an in-memory store per simulated world (the launcher refuses "
       "them in its own code)"),
    _P("torch.distributed.rendezvous._query_to_dict", "adapters.torch_globals", "reads",
       "rank= and world_size= of an init_method URL, read as torch reads them"),
    _P("torch._C._distributed_c10d._set_thread_isolation_mode", "adapters.torch_native, isolation.child", "reads",
       "functional collectives find groups by name in a registry: per thread while thread ranks run"),
    _P("torch._C._distributed_c10d._register_process_group", "adapters.threads", "reads",
       "a thread a rank starts registers its rank's groups in its own per-thread registry"),
    _P("torch._C._distributed_c10d.Backend._set_sequence_number_for_group", "adapters.process_group", "overrides",
       "what torch asks of a group's backend (_get_backend) when it creates the group: nothing to do"),
    _P(f"{_PG}._get_backend_name", "adapters.process_group", "overrides",
       "Python callers see the backend the program named (gloo, nccl); the C++ side sees 'sim'"),
    _P(f"{_PG}._device_types", "adapters.process_group", "overrides",
       "the named backend's devices: object collectives and checkpointing choose their device by it"),
    _P(f"{_PG}._get_backend", "adapters.process_group", "overrides",
       "torch asks a group's backend capability questions (splitting, coalescing): gloo's answers"),
    _P(f"{_PG}._get_sequence_number_for_group", "adapters.process_group", "overrides",
       "the group's count of operations, the same on every member (torch's C++ asks a backend the simulated group "
       "does not have)"),
    _P(f"{_PG}._set_sequence_number_for_group", "adapters.process_group", "overrides",
       "starts the count above"),
    _P("torch.utils._python_dispatch", "adapters.process_group_work", "reads",
       "the module holding torch's dispatch-mode stack (below)"),
    _P("torch.utils._python_dispatch._get_current_dispatch_mode_stack", "adapters.process_group_work", "reads",
       "whether a CommDebugMode watches: a simulated group's calls never pass torch's dispatcher, so the mode is "
       "handed each call's c10d op (c10d.allreduce_, ...) as a real group's dispatcher would"),
    _P("torch.utils._python_dispatch._disable_current_modes", "adapters.process_group_work", "reads",
       "runs the call itself with the modes off, as the c10d op's kernel runs on a real group"),
    _P("torch.distributed.tensor.debug._comm_mode", "adapters.process_group_work", "reads",
       "where CommDebugMode is defined (looked up in sys.modules only: a program that never imported it pays "
       "nothing)"),
    _P(f"{_C10D}._create_process_group_wrapper", "adapters.torch_native, adapters.pg_wrapper", "patches",
       "TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper over a real gloo helper group: a simulated group gets the "
       "wrapper's checks over a simulated helper (adapters.pg_wrapper)"),
    _P("torch.distributed._create_process_group_wrapper", "adapters.torch_native, adapters.pg_wrapper", "patches",
       "the same function as torch.distributed re-exports it (what a program calling it itself reaches)"),
    _P("torch._C.fork", "adapters.process_group_work", "reads",
       "a completed future typed as a C++ backend's (a TensorList), which c10d's built-in DDP hooks require"),
    _P(f"{_PG}._start_coalescing", "adapters.process_group", "overrides", "refused as gloo refuses it"),
    _P(f"{_PG}._end_coalescing", "adapters.process_group", "overrides", "refused as gloo refuses it"),
    _P(f"{_PG}._allgather_base", "adapters.process_group", "overrides", "torch's other name for all_gather_single"),
    _P(f"{_PG}._reduce_scatter_base", "adapters.process_group", "overrides",
       "torch's other name for reduce_scatter_single"),
    _P("torch.distributed.Work._source_rank", "adapters.process_group", "overrides",
       "the sender of a recv from any source, as a group rank"),
    _P("torch.distributed.fsdp._debug_utils.SimpleProfiler.profiling", "adapters.torch_tables", "patches",
       "FSDP1 keeps 'being profiled' in a class-level set around optim_state_dict's collectives: per rank thread"),
    _P("torch.distributed.fsdp._debug_utils.SimpleProfiler.results", "adapters.torch_tables", "patches",
       "FSDP1's profiler results, a class-level table: per rank thread"),
    _P("torch.distributed.tensor._dispatch.OpDispatcher._custom_op_handlers", "adapters.torch_tables", "patches",
       "loss_parallel() adds and pops its handlers in this one process-wide table: per rank thread", static=True),
    _P("torch.nn.parallel.distributed.DistributedDataParallel._get_ddp_logging_data", "adapters.torch_tables",
       "patches", "DDP's logging data names the backend the program named, not 'sim'"),
    _P("torch._C._autograd._profiler_enabled", "adapters.torch_profiling", "reads",
       "a group operation opens a profiler event only while a profiler is on"),
    _P("torch._C._profiler._RecordFunctionFast", "adapters.torch_profiling", "reads",
       "the '<backend>:<operation>' event a real backend shows torch's profiler"),
    # -- torch.distributed.rpc (adapters.torch_rpc) -------------------------------------------------------------
    _P("torch.distributed.rpc.api._require_initialized", "adapters.torch_rpc", "reads",
       "rpc_sync & co. are its wrappers: what each wraps (its closure cell) is routed on simulated ranks"),
    _P("torch.distributed.rpc.api._is_current_rpc_agent_set", "adapters.torch_rpc", "patches",
       "the wrappers' 'is an agent set?' check answers for the simulated worker (the package's copy too, which "
       "torch's sharded tensors ask)"),
    _P("torch.distributed.rpc.api._get_current_rpc_agent", "adapters.torch_rpc", "patches",
       "torch's sharded tensors read the worker infos of the current agent (the package's copy too)"),
    _P("torch.distributed.rpc.api._all_gather", "adapters.torch_rpc", "patches",
       "ShardedTensor(init_rrefs=True) gathers its ids over RPC; torch's version keeps its state in module tables "
       "that rank threads would share"),
    _P("torch.distributed.rpc._init_rpc_backend", "adapters.torch_rpc, isolation.rpc_process", "patches",
       "init_rpc, imported by name before the world started, reaches the simulated agent through it; in a coop "
       "rank process torch's own agent starts outside the schedule"),
    _P("torch.distributed.rpc._set_profiler_node_id", "adapters.torch_rpc", "patches", "skipped on simulated ranks"),
    _P("torch.distributed.autograd._init", "adapters.torch_rpc", "patches", "skipped on simulated ranks"),
    _P("torch.distributed.autograd._new_context", "adapters.torch_rpc", "patches",
       "torch's autograd context class calls it: the simulated ranks' contexts"),
    _P("torch.distributed.autograd._release_context", "adapters.torch_rpc", "patches",
       "torch's autograd context class calls it: the simulated ranks' contexts"),
    _P("torch._C._collect_all", "adapters.torch_rpc", "patches",
       "torch.futures.collect_all/wait_all wait cooperatively for futures that answer later"),
    # -- the standard library ---------------------------------------------------------------------------------
    _P("importlib._bootstrap._find_and_load", "adapters.clock_hooks, isolation.child", "patches",
       "an outermost import's CPU time is not the rank's compute"),
    _P("threading.Thread._bootstrap_inner", "adapters.threads, isolation.rank_threads", "patches",
       "a thread a rank starts runs as an actor of that rank"),
    _P("threading._shutdown", "isolation.child", "reads",
       "a rank process ends as an interpreter does: it joins the non-daemon threads"),
    _P("atexit._run_exitfuncs", "isolation.child", "reads", "a rank process runs its atexit handlers at its end"),
    _P("weakref.finalize._registry", "isolation.child", "reads",
       "a rank process skips torch's exit-time deregistration of its operator libraries (it ends by os._exit)"),
    _P("torch.library._del_library", "isolation.child", "reads",
       "the finalizer of torch's operator libraries, detached at a rank process's end"),
    _P("random._inst", "core._handoff", "reads", "the generator behind random.random(): one state per rank"),
    _P("multiprocessing.context._default_context._actual_context", "launch, torch_harness", "patches",
       "set_start_method() in a launcher run belongs to that run: put back after it"),
    _P("multiprocessing.process.BaseProcess._popen", "launch, isolation.launched", "patches",
       "a started process is a simulated rank: its Popen stands in for the child", static=True),
    _P("multiprocessing.process.BaseProcess._sentinel", "launch, isolation.launched", "patches",
       "a simulated rank's sentinel is made on demand", static=True),
    _P("multiprocessing.process.BaseProcess._target", "launch", "reads",
       "what the process runs tells a rank (the program's code) from a library's worker", static=True),
    _P("multiprocessing.process.BaseProcess._args", "launch", "patches",
       "each rank gets its own copy of the arguments, as a child does", static=True),
    _P("multiprocessing.process.BaseProcess._kwargs", "launch", "patches",
       "each rank gets its own copy of the arguments, as a child does", static=True),
    _P("multiprocessing.process.BaseProcess._check_closed", "launch", "reads",
       "a closed process refuses start() and sentinel as multiprocessing does"),
    _P("multiprocessing.context.SpawnProcess._start_method", "launch", "reads",
       "the start method decides which tensors a rank shares with the launcher"),
    _P("multiprocessing.connection._ConnectionBase", "adapters.os_waits", "patches",
       "a pipe's (and a queue's) blocking read that another rank or the launcher answers waits out of coop's turn"),
    _P("multiprocessing.synchronize.SemLock._make_methods", "adapters.os_waits", "patches",
       "a lock's blocking acquire (an attribute it makes per lock) waits out of coop's turn"),
    _P("multiprocessing.synchronize.SemLock._semlock", "adapters.os_waits", "reads",
       "the lock under a multiprocessing lock: tried without blocking first", static=True),
    *(_P(f"torch.distributed.elastic.multiprocessing.api.LogsSpecs.{name}", "launch_elastic", "reads",
         "elastic_launch's log specs say where each worker's streams go (no public getter)", static=True)
      for name in ("_redirects", "_tee", "_local_ranks_filter")),
    # -- the core and the rank processes -----------------------------------------------------------------------
    _P("torch._C._set_grad_enabled", "core.backend", "reads", "collective kernels run without autograd"),
    _P("torch._C._AutoDispatchBelowADInplaceOrView", "core.backend, isolation.staging", "reads",
       "collective kernels write below autograd's in-place/view bookkeeping, as c10d's C++ kernels do"),
    _P("torch.UntypedStorage._share_fd_cpu_", "isolation.child", "reads",
       "a rank process shares a tensor's storage with the coordinator by file descriptor"),
    _P("torch.UntypedStorage._new_shared_fd_cpu", "isolation._wire", "reads",
       "the coordinator maps a rank process's shared storage"),
    _P("torch.UntypedStorage._new_using_fd_cpu", "isolation.staging", "reads",
       "a large storage a rank process uses again gets a shared-memory block of its size"),
    _P("torch.UntypedStorage._swap_data_ptr_", "isolation.staging", "reads",
       "...and moves into it in place (every view follows), or back to ordinary memory before a resize"),
    _P("torch.UntypedStorage._cdata", "isolation.staging", "reads",
       "a storage's identity across the Python objects that stand for it (the moved storages, the ones seen once)"),
    # -- PyTorch's own test harness (torch_harness, harness_diff) ------------------------------------------------
    _P("torch.testing._internal.common_fsdp.patch_all_gather", "torch_harness_state", "reads",
       "torch's FSDP test helpers that patch by assignment on every rank (their code marks a test for rank "
       "processes, as unittest.mock does)"),
    _P("torch.testing._internal.common_distributed.MultiProcessTestCase", "torch_harness", "reads",
       "the harness whose rank processes become simulated ranks", static=True),
    _P("torch.testing._internal.distributed._tensor.common_dtensor.LocalDTensorTestBase", "torch_harness", "reads",
       "torch's LocalTensor tests run every rank in the test's process: nothing to simulate"),
    _P("torch.testing._internal.distributed._tensor.common_dtensor.LocalDTensorContinuousTestBase", "torch_harness",
       "reads", "likewise, for its continuous tests"),
    _P("torch.testing._internal.distributed.rpc.rpc_agent_test_fixture.RpcAgentTestFixture", "torch_harness",
       "reads", "tests of torch's RPC test fixtures test torch's own agent: they run on rank processes"),
    _P("torch.testing._internal.common_distributed.get_timeout", "torch_harness", "reads",
       "the harness's bound on one test", static=True),
    _P("torch.testing._internal.common_distributed.TEST_SKIPS", "torch_harness", "reads",
       "the exit codes a rank skips a test with", static=True),
    _P("torch.testing._internal.distributed.distributed_test.Barrier", "torch_harness_state", "patches",
       "distributed_test's barrier counts in class state: one class per rank", static=True),
    _P("torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase", "harness_diff",
       "reads", "the test file it writes runs torch's distributed_test as test_distributed_spawn.py does",
       static=True),
    _P("torch.testing._internal.distributed.distributed_test.TestDistBackend", "harness_diff", "reads",
       "the test file it writes runs torch's distributed_test as test_distributed_spawn.py does", static=True),
    _P("torch.testing._internal.common_utils.run_tests", "harness_diff", "reads",
       "the test file it writes runs torch's distributed_test as test_distributed_spawn.py does", static=True),
    _P("torch.testing._internal.common_utils.TestCase._precision", "torch_harness_state", "reads",
       "instantiate_device_type_tests' thread-local precision starts from it on each rank thread", static=True),
    _P("torch.testing._internal.common_utils.TestCase._rel_tol", "torch_harness_state", "reads",
       "instantiate_device_type_tests' thread-local tolerance starts from it on each rank thread", static=True),
    _P("torch.testing._internal.common_device_type.DeviceTypeTestBase._tls", "torch_harness_state", "patches",
       "a thread-local whose importing thread holds the default precision: one per rank", static=True),
    *(_P(f"{_HOOKS}.{table}", "torch_harness_state", "patches",
         "torch.nn's process-wide module hooks (ModTracker, CommDebugMode): one table per thread rank")
      for table in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                    "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")),
    *(_P(f"torch.autograd.profiler.profile.{step}", "torch_harness_state", "patches",
         "the profiler is one per process: starting it on a thread rank fails, naming the fix")
      for step in ("_prepare_trace", "_start_trace")),
    # -- libraries' process-wide singletons (adapters.per_rank_state) ------------------------------------------
    _P("torch.distributed.device_mesh.DeviceMesh._thread_id", "adapters.per_rank_state", "patches",
       "what tells thread ranks' meshes apart in torch (its threaded backend sets it): a simulated rank's identity",
       static=True),
    _P("torch.distributed.device_mesh.DeviceMesh._hash", "adapters.per_rank_state", "patches",
       "the mesh's hash, computed lazily from the identity above: reset after setting it", static=True),
    _P("torch.distributed.tensor._redistribute._gen_transform_infos", "adapters.per_rank_state", "reads",
       "a cache keyed by meshes: emptied when a world ends"),
    _P("torch.distributed.tensor._redistribute._planner_cache", "adapters.per_rank_state", "reads",
       "a cache keyed by meshes: emptied when a world ends"),
    _P("torch.distributed.tensor._collective_utils.MeshTopoInfo.build_from_mesh", "adapters.per_rank_state", "reads",
       "a cache keyed by meshes: emptied when a world ends"),
    _P("torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_cached",
       "adapters.per_rank_state", "reads", "a cache keyed by meshes' specs: emptied when a world ends"),
    _P("hydra.core.singleton.Singleton._instances", "adapters.per_rank_state", "patches",
       "Hydra's run state (GlobalHydra...) is one per thread rank", optional=True),
    # -- the CUDA stand-in (simulator.standin.PRIVATE_TORCH_NAMES is built from these) ----------------------
    *(_P(f"torch.cuda.{name}", "standin.install, standin.cuda_api", "patches",
         "torch.cuda's private entry points, which its public functions, torch.cuda.device and DDP/DTensor call")
      for name in ("_lazy_init", "_initialized", "_exchange_device", "_maybe_exchange_device")),
    _P("torch.cuda.nvtx._nvtx", "standin.install", "patches", "NVTX ranges are no-ops on stand-ins"),
    _P("torch.ops.aten._local_scalar_dense", "standin.install", "overrides",
       "item() of a stand-in where the Python key is excluded (the legacy constructors torch.Tensor([a, b]) read "
       "0-dim elements so): registered for PrivateUse1"),
    _P("torch._higher_order_ops.flex_attention", "standin.flex", "patches",
       "flex_attention's autograd rule (its py_kernels entry and dispatch cache): stand-in inputs run it on the "
       "CPU, forward and backward; the operator has no rule for a tensor subclass"),
    *(_P(f"torch.cuda.memory.{name}", "standin.install, standin.cuda_api", "patches",
         "the caching allocator's memory history: refused on stand-ins, naming the counters there are")
      for name in ("_record_memory_history", "_snapshot", "_dump_snapshot")),
    *(_P(f"torch._C.{name}", "standin.install", "patches",
         "torch.accelerator and torch.distributed ask these which accelerator there is and for its state")
      for name in ("_get_accelerator", "_accelerator_getAccelerator", "_accelerator_getDeviceIndex",
                   "_accelerator_setDeviceIndex", "_accelerator_exchangeDevice", "_accelerator_maybeExchangeDevice",
                   "_accelerator_synchronizeDevice", "_accelerator_getStream", "_accelerator_setStream",
                   "_accelerator_emptyCache", "_accelerator_getDeviceStats", "_accelerator_resetPeakStats",
                   "_accelerator_resetAccumulatedStats", "_accelerator_getMemoryInfo",
                   "_accelerator_isAllocatorInitialized")),
    *(_P(f"torch._C.{name}", "standin.install, standin.multi_gpu", "patches",
         "nn.DataParallel's copies between one process's GPUs (CUDA builds only: absent from CPU builds)",
         cuda_build=True)
      for name in ("_broadcast", "_broadcast_out", "_broadcast_coalesced", "_scatter", "_scatter_out", "_gather",
                   "_gather_out")),
    _P("torch._dynamo.eval_frame.OptimizedModule", "standin.refuse", "reads",
       "torch.compile of a stand-in model: torch's compiled-module wrapper, its calls run eagerly"),
    _P("torch._dynamo.eval_frame.DisableContext", "standin.refuse", "reads",
       "torch.compile of a stand-in model: the wrapper's dynamo context, disabled"),
    _P("torch.distributed.fsdp._init_utils.is_traceable_wrapper_subclass", "standin.fsdp1", "patches",
       "FSDP1's sync_module_states flattens wrapper subclasses: a stand-in is broadcast as itself"),
    _P("torch.distributed.fsdp._flat_param.FlatParamHandle.to_cpu", "standin.fsdp1", "patches",
       "FSDP1's offload_to_cpu moves the flat parameter by assigning .data: a stand-in stays on its device"),
    _P("torch.distributed.fsdp._state_dict_utils._full_post_state_dict_hook", "standin.fsdp1", "patches",
       "FSDP1's full state dict with offload_to_cpu: the cloned parameters are copied to the CPU"),
    _P("torch._C._InferenceMode", "standin.tensor", "reads",
       "a view of a normal tensor taken in inference mode is wrapped as a normal tensor, as torch makes the view"),
    _P("torch._C._set_conj", "standin.tensor", "reads", "a lazy conjugate view's bit, carried on its stand-in"),
    _P("torch._C._set_neg", "standin.tensor", "reads", "a lazy negative view's bit, carried on its stand-in"),
    _P("torch._C._AutoDispatchBelowAutograd", "standin.install", "reads",
       "silu_backward & co on stand-ins: past the composite registered for other devices, to the CPU kernel"),
    _P("torch._C._len_torch_function_stack", "standin.install", "reads",
       "torch.tensor under a default device: whether a mode may name a bare cuda (cheap, before the stack)"),
    _P("torch.overrides._get_current_function_mode_stack", "standin.install", "reads",
       "torch.tensor under a default device: the innermost DeviceContext's device"),
    _P("torch.utils._device.DeviceContext", "standin.install", "reads",
       "torch.set_default_device's mode: a bare cuda there is the current GPU"),
    _P("torch.autograd._engine_run_backward", "standin.install", "patches",
       "backward runs on the calling rank thread, never on a device thread"),
    _P("torch.autograd.graph._engine_run_backward", "standin.install", "patches",
       "backward runs on the calling rank thread, never on a device thread"),
    _P("torch._C._acc.register_python_privateuseone_device_guard", "standin._native", "reads",
       "stand-ins are privateuseone tensors: their device guard"),
    _P("torch._C._acc.register_python_privateuseone_hook", "standin._native", "reads",
       "stand-ins are privateuseone tensors: their hooks"),
    _P("torch._C._acc.DeviceGuard", "standin._native", "subclasses", "the stand-ins' device guard"),
    _P("torch._C._acc.PrivateUse1Hooks", "standin._native", "subclasses", "the stand-ins' privateuseone hooks"),
    _P("torch._C._rename_privateuse1_backend", "standin._native", "reads", "the privateuseone backend's name"),
    _P("torch._C._get_privateuse1_backend_name", "standin._native", "reads", "the privateuseone backend's name"),
    _P("torch._C._autograd.DeviceType", "standin._native, standin.streams", "reads",
       "the device type numbers of CUDA and privateuseone"),
    _P("torch._C._ExcludeDispatchKeyGuard", "standin.amp", "reads", "autocast kernels run below autocast"),
    _P("torch._C.DispatchKey", "standin.amp", "reads", "the autocast dispatch key of privateuseone"),
    _P("torch._C.DispatchKeySet", "standin.amp", "reads", "the autocast dispatch key of privateuseone"),
    *(_P(f"torch._C.{name}", "standin.ops", "reads",
         "on a CUDA build (without a GPU): the factories with a CUDA kernel of their own, which the stand-in "
         "registers its factory over (on a CPU build a fallback reaches them)")
      for name in ("_dispatch_get_all_op_names", "_dispatch_has_kernel_for_dispatch_key")),
    _P("torch._C._dispatch_has_computed_kernel_for_dispatch_key", "standin.tensor", "reads",
       "an operator without a CPU kernel is refused with a clear error"),
    _P("torch._C._disabled_torch_function_impl", "standin.tensor", "reads",
       "the stand-in tensor subclass opts out of __torch_function__"),
    _P("torch._C._disabled_torch_dispatch_impl", "standin.tensor", "reads",
       "a tensor subclass with a __torch_dispatch__ of its own is left to unwrap itself first (NotImplemented)"),
    _P("torch._C._DisableTorchDispatch", "standin.tensor", "reads",
       "an in-place reshape takes effect on the wrapper through .data=, below the stand-in's own dispatch"),
    _P("torch.distributed._functional_collectives.AsyncCollectiveTensor", "standin.ops", "reads",
       "a functional collective's result wraps the stand-in, as it wraps a GPU tensor"),
    _P("torch._C.TensorBase", "standin.install, standin.tensor", "reads",
       "the C++ descriptors of device, is_cuda and data, behind the stand-in's properties"),
    _P("torch._C.default_generator", "standin.rng", "reads",
       "the devices' generators draw through the CPU generator"),
    _P("torch.Tensor._make_wrapper_subclass", "standin.install, standin.tensor", "patches",
       "wrapper subclasses made on a stand-in device"),
    _P("torch._ops.OpOverload._op", "standin.tensor", "reads",
       "the operator itself, called without OpOverload.__call__'s frame", static=True),
    _P("torch._tensor_str._str", "standin.tensor", "reads", "torch's tensor printer, for stand-in tensors"),
    _P("torch.utils._device._device_constructors", "standin.install", "reads",
       "torch's cache of default-device constructors, filled before torch.tensor is replaced"),
    _P("torch.serialization._package_registry", "standin.install, standin.serialization", "patches",
       "torch.load restores cuda-tagged storages through this registry's cuda entry"),
    _P("torch._subclasses.fake_tensor.FakeTensorMode.cache", "standin.install, standin.fakecache", "patches",
       "the fake-tensor dispatch cache, one per process: keyed by the current device while enabled"),
    _P("torch._has_compatible_shallow_copy_type", "standin.jit", "reads",
       "a ScriptModule's _apply keeps a parameter's identity by .data = where Module._apply would"),
    _P("torch.jit.ScriptModule._apply", "standin.install, standin.jit", "patches",
       "a TorchScript module's parameters move onto stand-ins in place, their C++ slots let go of them meanwhile"),
    _P("torch.nn.utils.parametrize._maybe_set", "standin.install, standin.swap", "patches",
       "removing a parametrization of a stand-in parameter sets it in place as on a GPU, not by a swap"),
    _P("torch._subclasses.meta_utils.is_traceable_wrapper_subclass", "standin.install, standin.fakecache",
       "patches", "the meta converter's subclass test: a stand-in is fakified as a plain tensor on cuda:i"),
    *(_P(f"torch.ops.aten.{op}", "standin.attention, standin.amp", "reads",
         "SDPA on stand-ins: CUDA's fused operators, computed by the CPU's fused kernel")
      for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_attention_math")),
    _P("torch.ops.aten._copy_from", "standin.install", "patches", "copies to and from stand-in devices"),
    _P("torch.ops.aten._copy_from_and_resize", "standin.install", "patches", "copies to and from stand-in devices"),
    *(_P(f"torch.cuda.jiterator.{name}", "standin.refuse, standin.install", "patches",
         "jiterator's entry points: refused on stand-ins, naming the fix") for name in (
        "_create_jit_fn", "_create_multi_output_jit_fn")),
    _P("torch.jit._builtins", "standin.install", "reads", "the module of TorchScript's builtin table (below)"),
    _P("torch.jit._builtins._find_builtin", "standin.install", "reads",
       "the aten operator TorchScript compiles torch.tensor (as_tensor, asarray) to"),
    _P("torch.jit._builtins._register_builtin", "standin.install", "reads",
       "the stand-in's torch.tensor (as_tensor, asarray) compiles as that operator: a *args wrapper cannot"),
)


# ---------------------------------------------------------------------------
# checking the names against what is installed
# ---------------------------------------------------------------------------
def _resolve(name: str) -> Any:
    """The object ``name`` denotes: the longest module prefix imported, then attributes (AttributeError)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    i = 1
    while i < len(parts):
        try:
            obj = importlib.import_module(".".join(parts[:i + 1]))
        except ImportError:  # (no such module: the rest are attributes)
            break
        i += 1
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


def _defines(body: Sequence[ast.stmt], attr: str) -> ast.AST | None:
    """The statement of ``body`` that defines ``attr`` (a def, a class, an assignment), looking into ``if``
    branches too (torch defines ``DeviceMesh`` under ``if not is_available(): ... else:``); a def or a class
    before an assignment."""
    found: ast.AST | None = None
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return node
        if isinstance(node, ast.If):
            inner = _defines([*node.body, *node.orelse], attr)
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return inner
            found = found or inner
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
            found = found or node
    return found


def _sets_on_self(cls: ast.ClassDef, attr: str) -> bool:
    """Whether a method of ``cls`` assigns ``self.<attr>`` (an attribute of its instances)."""
    return any(isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self"
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])) for n in ast.walk(cls))


def _defined_in_source(name: str) -> bool:
    """Whether ``name`` is defined in its module's source, found without running the module (only the packages
    above it)."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    i = 1
    while spec is not None and spec.submodule_search_locations is not None and i < len(parts):
        child = importlib.util.find_spec(".".join(parts[:i + 1]))  # runs the package above it, never the module
        if child is None:
            break
        spec, i = child, i + 1
    if spec is None or i == len(parts):
        return spec is not None
    if not (spec.origin or "").endswith(".py"):
        return False
    with open(spec.origin, encoding="utf-8") as f:
        body: Sequence[ast.stmt] = ast.parse(f.read(), spec.origin).body
    owner: ast.AST | None = None
    for attr in parts[i:]:
        node = _defines(body, attr)
        if node is None:
            return attr == parts[-1] and isinstance(owner, ast.ClassDef) and _sets_on_self(owner, attr)
        owner = node
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _cuda_build() -> bool:
    return bool(torch.backends.cuda.is_built())


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name.split(".")[0]) is not None


def missing_private_names(names: Sequence[PrivateName] = PRIVATE_NAMES) -> list[PrivateName]:
    """The records of ``names`` that the installed packages lack (an optional library not installed: skipped)."""
    out = []
    for p in names:
        if (p.optional and not _installed(p.name)) or (p.cuda_build and not _cuda_build()):
            continue
        if p.static:
            found = _defined_in_source(p.name)
        else:
            try:
                _resolve(p.name)
                found = True
            except (AttributeError, ImportError):
                found = False
        if not found:
            out.append(p)
    return out


def check_private_names(names: Sequence[PrivateName] = PRIVATE_NAMES) -> None:
    """Raise, naming each one and what uses it, when the installed torch lacks a private name the simulator uses.

    Imports the torch modules the names live in (FSDP, DTensor: seconds), so it runs in a test or by hand
    (``python -m simulator.adapters.torch_private``), not when the simulator starts.
    """
    missing = missing_private_names(names)
    if missing:
        raise DistRuntimeError(format_message(
            "simulator.adapters.torch_private", f"the installed torch lacks {len(missing)} private name(s) that the "
            "simulator uses: " + "; ".join(f"{p.name} ({p.how} by simulator.{p.users}: {p.why})" for p in missing),
            values={"torch": torch.__version__, "supported": list(SUPPORTED_TORCH)},
            fix="install a supported torch (e.g. pip install torch==2.13.0), or adapt the named modules to the "
                "new release and update simulator/adapters/torch_private.py"))


if __name__ == "__main__":  # pragma: no cover
    check_private_names()
    print(f"torch {torch.__version__}: all {len(PRIVATE_NAMES)} private names the simulator uses are present")
