"""The decode step ahead of time: one decode step of a KDSA model over a `KDSAStaticCache`, exported with
`torch.export` and compiled by AOTInductor into a package that runs without Python around the graph
(docs/graph-mode.md §14).

    from modeling_kdsa.aot import compile_decode_step, load_decode_step
    from modeling_kdsa.static_cache import KDSAStaticCache

    cache = KDSAStaticCache(model.config, max_cache_len=4096)
    model(prompt[:, :1], cache=cache)                    # any eager forward: allocates the cache's tensors
    path = compile_decode_step(model, cache, "step.pt2")  # once; later processes only load it
    load_decode_step(path, model, cache)                  # binds the package to the cache
    cache.reset()
    tokens = model.generate(prompt, cache=cache, max_new_tokens=64)  # eager prefill, then the package's steps

A step compiled by `torch.compile` (generate(cache_implementation="static"), §2) still runs Python each step: dynamo's
guard check over the whole model and inductor's Python wrapper (§11). An AOTInductor package is the same kind of graph
behind a C++ wrapper with no guards. What it costs: it is fixed to the shapes it was exported with (batch, cache
capacity, dtype, one new token a step), nothing checks its inputs but `DecodeStep`, and it is compiled with the
intra-op thread count of the compiling process.

The cache's tensors (KDA states, page pools, block tables, token counts) are buffers of the exported module
(`DecodeStepModule`, the pattern of transformers' `TorchExportableModuleWithStaticCache`), updated in place by the
step. The package holds neither weights nor cache (`package_constants_in_so=False`): `load_decode_step` hands it the
model's parameters and the cache's tensors to use in place (`user_managed=True`), so eager forwards and the package's
steps share one cache and the weights sit in memory once. The decode step's C++ kernels enter the program as `kdsa::`
ops (`cpu_extension.kernels_in_export`): the package runs in a process that has imported this package, which
registers them.
"""

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from modeling_kdsa import kernels
from modeling_kdsa.cache import map_planes
from modeling_kdsa.cpu_extension import kernels_in_export
from modeling_kdsa.numeric_formats import stored_planes
from modeling_kdsa.static_cache import KDSAStaticCache, StaticKDALayer

# Inductor's joint-graph constant folding treats every buffer as a constant: it would evaluate the token counts'
# increment (0-d buffers, "uniform" values) once at compile time, and every step would write the same count.
# The cache's buffers change every step, so that folding is off (docs/graph-mode.md §14).
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False, "joint_graph_constant_folding": False}
_METADATA_KEY = "kdsa_decode_step"


def _cache_slots(cache: KDSAStaticCache) -> list[tuple[object, object]]:
    """Every place the cache keeps a tensor a step reads or writes, as (container, attribute name or list index)."""
    slots = [(cache, "cumulative_length")]
    for layer in cache.layers:
        if isinstance(layer, StaticKDALayer):
            slots += [(layer.conv_states, 0), (layer.recurrent_states, 0)]
            continue
        slots += [(layer, name) for name in layer.paged_store_names]
        slots += [(layer, "block_table"), (layer, "num_tokens")]
        if hasattr(layer, "pool_origin"):
            slots.append((layer, "pool_origin"))
    return slots


def _get(container, key):
    return container[key] if isinstance(key, int) else getattr(container, key)


def _set(container, key, value) -> None:
    if isinstance(key, int):
        container[key] = value
    else:
        setattr(container, key, value)


def _check_initialized(cache: KDSAStaticCache) -> None:
    """The cache's tensors exist only after its first write: an eager forward must come first."""
    if not isinstance(cache, KDSAStaticCache):
        raise TypeError(f"the decode step is exported over a KDSAStaticCache, got {type(cache).__name__}")
    missing = [
        index
        for index, layer in enumerate(cache.layers)
        if (layer.recurrent_states[0] is None if isinstance(layer, StaticKDALayer) else not layer.is_initialized)
    ]
    if missing:
        raise ValueError(
            f"the cache's layers {missing} hold no tensors yet: run one eager forward with this cache first (e.g. "
            "the prompt's prefill, or one token then cache.reset()), which allocates them at their fixed addresses"
        )


class DecodeStepModule(nn.Module):
    """One decode step of `model` over `cache` as a module whose buffers are the cache's tensors: forward(input_ids
    `[B, 1]`, attention_mask `[B, capacity]`, position_ids `[B, 1]`) -> logits `[B, 1, vocab]`, the cache updated in
    place. The forward first puts its buffers into the cache (`bind_cache`): under `torch.export` the model then
    writes the traced buffers, which the program mutates, rather than tensors the tracer would take for constants."""

    def __init__(self, model, cache: KDSAStaticCache):
        super().__init__()
        _check_initialized(cache)
        self.model = model
        self.cache = cache
        self.buffer_names = []
        for container, key in _cache_slots(cache):
            for plane in stored_planes(_get(container, key)):
                name = f"cache_{len(self.buffer_names)}"
                self.register_buffer(name, plane, persistent=False)
                self.buffer_names.append(name)

    def bind_cache(self) -> None:
        """Put the module's buffers (the traced ones while exporting) into the cache's slots."""
        buffers = iter([getattr(self, name) for name in self.buffer_names])
        # The slots are looked up anew each time: torch.export replaces the containers held in a module's attributes.
        for container, key in _cache_slots(self.cache):
            _set(container, key, map_planes(_get(container, key), lambda _: next(buffers)))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        self.bind_cache()
        return self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=self.cache, use_cache=True
        ).logits


def batch_size_of(cache: KDSAStaticCache) -> int:
    """The batch an initialized static cache was allocated for."""
    layer = cache.layers[0]
    return layer.recurrent_states[0].shape[0] if isinstance(layer, StaticKDALayer) else layer.block_table.shape[0]


def export_decode_step(model, cache: KDSAStaticCache) -> torch.export.ExportedProgram:
    """`torch.export` of one decode step (`DecodeStepModule`) at the cache's batch size and capacity, the C++ kernels
    traced as `kdsa::` ops. The cache must hold its tensors (one eager forward first); exporting leaves them and their
    contents as they were."""
    module = DecodeStepModule(model, cache).eval()
    device = next(model.parameters()).device
    batch_size = batch_size_of(cache)
    example = (
        torch.zeros(batch_size, 1, dtype=torch.long, device=device),
        torch.ones(batch_size, cache.capacity, dtype=torch.long, device=device),
        torch.zeros(batch_size, 1, dtype=torch.long, device=device),
    )
    kda_layers = [layer for layer in cache.layers if isinstance(layer, StaticKDALayer)]
    had_state = [layer.has_previous_state[0] for layer in kda_layers]
    try:
        # A KDA layer without a previous state starts from zeros instead of reading its conv window and state: a branch
        # taken at trace time. A decode step follows a prefill, so it is traced reading them (a reset cache's states
        # are zeros: the same result).
        for layer in kda_layers:
            layer.has_previous_state[0] = True
        with torch.no_grad(), kernels_in_export():
            return torch.export.export(module, example, strict=False)
    finally:
        module.bind_cache()  # the trace left its fakes in the cache's slots: the real tensors back
        for layer, had in zip(kda_layers, had_state, strict=True):
            layer.has_previous_state[0] = had


def _constants(model, cache: KDSAStaticCache) -> dict[str, torch.Tensor]:
    """The exported step's constants by name: the model's parameters and buffers, and the cache's tensors."""
    module = DecodeStepModule(model, cache)
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    return dict(named)


def _manifest(model, cache: KDSAStaticCache) -> dict:
    """What a package is fixed to: the batch, the capacity, the intra-op threads, every constant's shape and dtype."""
    return {
        "batch_size": batch_size_of(cache),
        "capacity": cache.capacity,
        "threads": torch.get_num_threads(),
        "constants": {name: [list(t.shape), str(t.dtype)] for name, t in _constants(model, cache).items()},
    }


def kernel_ops(program: torch.export.ExportedProgram) -> list[str]:
    """The `kdsa::` ops an exported step calls, by name (e.g. "row_linear")."""
    targets = {node.target for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes if node.op == "call_function"}  # fmt: skip
    return sorted(t._opname for t in targets if isinstance(t, torch._ops.OpOverload) and t.namespace == "kdsa")


def register_kernels(ops: list[str]) -> None:
    """Build (or find) and register the CPU kernels of `ops` in this process (the kernel registry's
    `kernels.CPU_KERNEL_OPS`); a ValueError names one that cannot be registered here. The package calls its ops through
    the dispatcher, and a process registers a kernel only when it first needs it: a process that loads a package
    registers the package's kernels first."""
    for op in ops:
        kernel_available = kernels.CPU_KERNEL_OPS.get(op)
        if kernel_available is None:
            raise ValueError(f"the package calls kdsa::{op}, an op this version of modeling_kdsa does not define")
        if not kernel_available():
            raise ValueError(
                f"the package calls kdsa::{op}, whose CPU kernel cannot be built or loaded in this process (see the "
                "warning above): load the package where the kernels build, or decode without it"
            )


def _check_compilable(cache: KDSAStaticCache) -> None:
    """What AOTInductor cannot compile, refused before the minute a compile takes."""
    planes = [plane for container, key in _cache_slots(cache) for plane in stored_planes(_get(container, key))]
    if any(plane.dtype == torch.float8_e8m0fnu for plane in planes):
        raise ValueError(
            "the cache holds MXFP8 indexer keys (E8M0 scales, quantization_config indexer='mxfp8'), which "
            "AOTInductor's C++ code generation cannot compile (torch 2.13 has no C++ type for float8_e8m0fnu there); "
            "use KDSAQuantizationConfig(indexer='bf16') for a package (the FP8 latent cache compiles)"
        )


def compile_decode_step(model, cache: KDSAStaticCache, package_path: str | Path) -> str:
    """Export the decode step (`export_decode_step`) and compile it with AOTInductor into the package
    `package_path` (a `.pt2` file; weights and cache not included). Returns the package's path."""
    _check_compilable(cache)
    program = export_decode_step(model, cache)
    manifest = {**_manifest(model, cache), "kernels": kernel_ops(program)}
    configs = {**INDUCTOR_CONFIGS, "aot_inductor.metadata": {_METADATA_KEY: json.dumps(manifest)}}
    return torch._inductor.aoti_compile_and_package(program, package_path=str(package_path), inductor_configs=configs)


class DecodeStep:
    """A loaded decode-step package bound to a model's weights and a static cache (`load_decode_step`).

    Loading binds it to the cache (`cache.decode_step`): the model's eager forward then runs every plain one-token step
    over that cache through it, so `model.generate(..., cache=cache)` decodes with the package (the prefill stays
    eager). `step(input_ids, attention_mask=None, position_ids=None)` runs one step directly: input_ids `[B, 1]`
    (int64, the cache's batch) -> logits `[B, 1, vocab]`, the cache one token longer. `attention_mask`: the padding
    mask `[B, capacity]` (1 = a real token; columns past the cached tokens are not read), default all ones;
    `position_ids` `[B, 1]`: the new tokens' positions, default the cached token count (right for sequences without
    padding). Nothing else checks the package's inputs: this call checks their shapes, the cache's capacity and, from
    a forward, that the forward's model is the one whose weights the package was given."""

    def __init__(self, runner, model, cache: KDSAStaticCache, batch_size: int):
        self.runner = runner
        self.model = model
        self.cache = cache
        self.batch_size = batch_size
        device = cache.cumulative_length.device
        self.full_mask = torch.ones(batch_size, cache.capacity, dtype=torch.long, device=device)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, model=None) -> torch.Tensor:
        if model is not None and model is not self.model:
            raise ValueError(
                "this KDSAStaticCache carries a decode-step package loaded with another model's weights: load it for "
                "this model (load_decode_step) or set cache.decode_step = None to decode eagerly"
            )
        column = (self.batch_size, 1)
        for name, tensor in (("input_ids", input_ids), ("position_ids", position_ids)):
            if tensor is not None and (tensor.shape != column or tensor.dtype != torch.long):
                raise ValueError(
                    f"the package takes {name} of shape {column}, int64 (one new token per sequence); got "
                    f"{tuple(tensor.shape)}, {tensor.dtype}"
                )
        if attention_mask is not None and attention_mask.shape != self.full_mask.shape:
            raise ValueError(
                f"the package takes a padding mask of shape {tuple(self.full_mask.shape)} (batch, cache capacity); "
                f"got {tuple(attention_mask.shape)}"
            )
        cached = int(self.cache.cumulative_length)
        if cached + 1 > self.cache.max_cache_len:
            raise ValueError(
                f"KDSAStaticCache capacity exceeded: {cached} cached + 1 new token > max_cache_len="
                f"{self.cache.max_cache_len}; nothing was written"
            )
        if attention_mask is None:
            attention_mask = self.full_mask
        if position_ids is None:
            position_ids = torch.full(column, cached, dtype=torch.long, device=self.full_mask.device)
        # The package reads its inputs with the strides they were traced with (contiguous) and checks nothing.
        return self.runner(input_ids.contiguous(), attention_mask.long().contiguous(), position_ids.contiguous())


def load_decode_step(package_path: str | Path, model, cache: KDSAStaticCache) -> DecodeStep:
    """Load a package from `compile_decode_step` and bind it to `model`'s weights and `cache`'s tensors (used in
    place), registering the C++ kernels it calls. The package must come from the same configuration, batch size and
    capacity: checked against the manifest it carries, with a ValueError naming the first difference."""
    _check_initialized(cache)
    runner = torch._inductor.aoti_load_package(str(package_path))
    metadata = runner.get_metadata()
    if _METADATA_KEY not in metadata:
        raise ValueError(f"{package_path} is not a KDSA decode-step package (no {_METADATA_KEY!r} metadata)")
    expected, actual = json.loads(metadata[_METADATA_KEY]), _manifest(model, cache)
    for field in ("batch_size", "capacity"):
        if expected[field] != actual[field]:
            raise ValueError(
                f"the package was compiled for {field}={expected[field]}, the cache has {field}={actual[field]}"
            )
    if expected["threads"] != actual["threads"]:
        warnings.warn(
            f"the package was compiled with {expected['threads']} intra-op threads and runs them whatever this process "
            f"sets ({actual['threads']}): inductor fixes each kernel's thread count at compile time",
            stacklevel=2,
        )
    register_kernels(expected["kernels"])
    constants = _constants(model, cache)
    for name in runner.get_constant_fqns():
        if name not in constants or actual["constants"][name] != expected["constants"][name]:
            got = actual["constants"].get(name, "nothing")
            raise ValueError(
                f"the package's constant {name!r} is {expected['constants'].get(name)} (shape, dtype); the model and "
                f"cache give {got}: compile the package for this model"
            )
    needed = set(runner.get_constant_fqns())
    runner.load_constants(
        {n: t for n, t in constants.items() if n in needed}, check_full_update=True, user_managed=True
    )
    cache.decode_step = DecodeStep(runner, model, cache, expected["batch_size"])
    return cache.decode_step
