# Type stubs of the private module exl2cpp._C, generated from a CPU build with
#   cd python && python -m pybind11_stubgen exl2cpp._C -o <dir>
# (the CUDA-only submodule cuda_bench is not listed). Regenerate after changing cpp/bindings/.
"""
exl2cpp runtime (private; use the exl2cpp package)
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['Calibration', 'Engine', 'KVCache', 'Model', 'PagePool', 'Sampler', 'SamplerSettings', 'build_info', 'cpu_isa', 'cpu_num_threads', 'cuda_can_access_peer', 'cuda_compiled', 'cuda_device_count', 'cuda_device_name', 'cuda_graph_stats', 'cuda_mem_info', 'cuda_pdl_enabled', 'cuda_set_pdl', 'dump_json', 'engine_cache_tokens', 'nccl_describe', 'nccl_set_library', 'exl2_dequantize', 'exl2_linear_bench', 'exl2_linear_bench_group', 'exl2_linear_forward', 'exl2_linear_forward_fused', 'exl2_linear_forward_group', 'exl2_linear_load', 'exl2_pack', 'exl2_unpack', 'exl2_validate', 'kv_rotate', 'load_config', 'numpy_roundtrip', 'op_add', 'op_argmax_logprob', 'op_attention_paged', 'op_attention_paged_q', 'op_attention_spans', 'op_bench_matmul_nt', 'op_convert', 'op_embedding', 'op_gather_rows', 'op_gelu_tanh_mul', 'op_kv_write', 'op_kv_write_q', 'op_layer_norm', 'op_logit_kl', 'op_matmul_nt', 'op_rms_norm', 'op_rope', 'op_sample_logprob', 'op_scale', 'op_silu_mul', 'parse_json', 'read_safetensors', 'read_tensor', 'safetensors_names', 'sampler_probs', 'set_cpu_isa', 'cuda_missing_reason', 'require_cuda_backend', 'decoder_names', 'get_options', 'set_options', 'default_options', 'option_registry', 'environment_settings', 'exl2_matmul_plan', 'exl2_matmul_plan_for_device', 'exl2_matmul_reference']
class Calibration:
    """The converter's calibration forward: one decoder layer at a time of an unquantized model through the runtime's decoder body, fp32, with capture hooks (model/calibration.h)."""
    def __init__(self, path: str, device: str, rows: typing.SupportsInt | typing.SupportsIndex, tokens: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def linears(self, layer: typing.SupportsInt | typing.SupportsIndex) -> list:
        ...
    def embed(self, ids: numpy.ndarray) -> None:
        ...
    def set_states(self, x: numpy.ndarray) -> None:
        ...
    def states(self) -> numpy.ndarray:
        ...
    def output(self) -> numpy.ndarray:
        ...
    def head_input(self) -> numpy.ndarray:
        ...
    def load_layer(self, layer: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def run(self, block: typing.SupportsInt | typing.SupportsIndex, hook: collections.abc.Callable | None = None) -> None:
        ...
    def input(self) -> numpy.ndarray:
        ...
    def input_hessian(self) -> numpy.ndarray:
        ...
    def input_rows(self) -> int:
        ...
    def set_weight(self, name: str, weight: numpy.ndarray) -> None:
        ...
    def reset_weight(self, name: str) -> None:
        ...
    def set_head_ref(self, head: numpy.ndarray) -> None:
        ...
    def head_kl(self, block: typing.SupportsInt = 0) -> float:
        ...
    def set_ref(self) -> None:
        ...
    def rel_err(self) -> float:
        ...
    def commit(self, from_ref: bool) -> None:
        ...
    def sync(self) -> None:
        ...
    @property
    def hidden(self) -> int:
        ...
    @property
    def moe(self) -> dict:
        """The MoE layers' sizes (experts 0: none)."""
    @property
    def n_blocks(self) -> int:
        ...
    @property
    def n_layers(self) -> int:
        ...
    @property
    def names(self) -> dict:
        ...
    @property
    def rows(self) -> int:
        ...
    @property
    def tokens(self) -> int:
        ...
class PagePool:
    def alloc(self, n: typing.SupportsInt | typing.SupportsIndex) -> list[int]:
        ...
    def refcount(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def release(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def retain(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def n_free(self) -> int:
        ...
    @property
    def n_pages(self) -> int:
        ...
    @property
    def n_used(self) -> int:
        ...
class KVCache:
    def k_mean(self, layer: typing.SupportsInt | typing.SupportsIndex) -> numpy.ndarray:
        ...
    @property
    def bytes_per_token(self) -> int:
        ...
    @property
    def k_centre(self) -> str:
        ...
    @property
    def sink(self) -> bool:
        ...
    @property
    def cache_type(self) -> str:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def layer_devices(self) -> list[str]:
        ...
    @property
    def n_layers(self) -> int:
        ...
    @property
    def tp(self) -> int:
        ...
    @property
    def n_pages(self) -> int:
        ...
    @property
    def page_size(self) -> int:
        ...
    @property
    def pool(self) -> PagePool:
        ...
class Model:
    @staticmethod
    def load(path: str, device: str = 'cpu', max_seq_len: typing.SupportsInt | typing.SupportsIndex = 0, layer_devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], head_device: typing.SupportsInt | typing.SupportsIndex = -1, tp_devices: collections.abc.Sequence[str] = [], progress: typing.Any = None) -> Model:
        """
        Load a model; layer_devices (one CUDA index per layer) and head_device split it across GPUs; tp_devices
        (e.g. ["cuda:0", "cuda:1"], or ["cpu"] * N virtual ranks) runs it tensor-parallel. progress(done,
        total) is called as modules load (embedding, each layer, head: total = layers + 2).
        """
    def forward(self, cache: KVCache, tokens: typing.Any, positions: typing.Any, seq_of_token: typing.Any, page_table: typing.Any, pages_per_seq: typing.SupportsInt | typing.SupportsIndex, logit_rows: typing.Any = None) -> numpy.typing.NDArray[numpy.float32]:
        """
        Run one batch step; returns float32 logits [rows, vocab] for logit_rows (all rows when None).
        """
    def info_json(self) -> str:
        ...
    def make_cache(self, n_tokens: typing.SupportsInt | typing.SupportsIndex, page_size: typing.SupportsInt | typing.SupportsIndex = 256, cache_type: str = 'auto') -> KVCache:
        ...
    @property
    def architecture(self) -> str:
        ...
    @property
    def config_json(self) -> str:
        ...
    @property
    def device(self) -> str:
        ...
    @property
    def head_device(self) -> str:
        ...
    @property
    def layer_devices(self) -> list[str]:
        ...
    @property
    def max_seq_len(self) -> int:
        ...
    @property
    def split(self) -> bool:
        ...
    @property
    def tp_devices(self) -> list[str]:
        ...
    @property
    def vocab_size(self) -> int:
        ...
class SamplerSettings:
    """
    Per-job sampling settings; see cpp/engine/sampler.h for the pipeline and ranges.
    """
    def __init__(self, *, temperature: typing.SupportsFloat | typing.SupportsIndex = 1.0, top_k: typing.SupportsInt | typing.SupportsIndex = 0, top_p: typing.SupportsFloat | typing.SupportsIndex = 1.0, min_p: typing.SupportsFloat | typing.SupportsIndex = 0.0, typical: typing.SupportsFloat | typing.SupportsIndex = 1.0, repetition_penalty: typing.SupportsFloat | typing.SupportsIndex = 1.0, frequency_penalty: typing.SupportsFloat | typing.SupportsIndex = 0.0, presence_penalty: typing.SupportsFloat | typing.SupportsIndex = 0.0, penalty_window: typing.SupportsInt | typing.SupportsIndex = -1, logit_bias: typing.Any = None, banned_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], allowed_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], min_tokens: typing.SupportsInt | typing.SupportsIndex = 0, stop_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], smoothing_factor: typing.SupportsFloat | typing.SupportsIndex = 0.0, smoothing_curve: typing.SupportsFloat | typing.SupportsIndex = 1.0, temperature_last: bool = False, min_temp: typing.SupportsFloat | typing.SupportsIndex = 1.0, max_temp: typing.SupportsFloat | typing.SupportsIndex = 1.0, temp_exponent: typing.SupportsFloat | typing.SupportsIndex = 1.0, top_a: typing.SupportsFloat | typing.SupportsIndex = 0.0, tfs: typing.SupportsFloat | typing.SupportsIndex = 1.0, mirostat_mode: typing.SupportsInt | typing.SupportsIndex = 0, mirostat_tau: typing.SupportsFloat | typing.SupportsIndex = 1.5, mirostat_eta: typing.SupportsFloat | typing.SupportsIndex = 0.3, xtc_probability: typing.SupportsFloat | typing.SupportsIndex = 0.0, xtc_threshold: typing.SupportsFloat | typing.SupportsIndex = 0.1, dry_multiplier: typing.SupportsFloat | typing.SupportsIndex = 0.0, dry_base: typing.SupportsFloat | typing.SupportsIndex = 1.75, dry_allowed_length: typing.SupportsInt | typing.SupportsIndex = 2, dry_range: typing.SupportsInt | typing.SupportsIndex = 0, dry_sequence_breakers: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], seed: typing.SupportsInt | typing.SupportsIndex = 0, top_logprobs: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        """
        SamplerSettings(**fields): keyword arguments only, each a field below (defaults: cpp/engine/sampler.h).
        """
    def __repr__(self) -> str:
        ...
    def validate(self, vocab: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    @property
    def allowed_tokens(self) -> list[int]:
        ...
    @property
    def banned_tokens(self) -> list[int]:
        ...
    @property
    def dry_allowed_length(self) -> int:
        ...
    @property
    def dry_base(self) -> float:
        ...
    @property
    def dry_multiplier(self) -> float:
        ...
    @property
    def dry_range(self) -> int:
        ...
    @property
    def dry_sequence_breakers(self) -> list[int]:
        ...
    @property
    def frequency_penalty(self) -> float:
        ...
    @property
    def logit_bias(self) -> list[tuple[int, float]]:
        ...
    @property
    def max_temp(self) -> float:
        ...
    @property
    def min_p(self) -> float:
        ...
    @property
    def min_temp(self) -> float:
        ...
    @property
    def min_tokens(self) -> int:
        ...
    @property
    def mirostat_eta(self) -> float:
        ...
    @property
    def mirostat_mode(self) -> int:
        ...
    @property
    def mirostat_tau(self) -> float:
        ...
    @property
    def penalty_window(self) -> int:
        ...
    @property
    def presence_penalty(self) -> float:
        ...
    @property
    def repetition_penalty(self) -> float:
        ...
    @property
    def seed(self) -> int:
        ...
    @property
    def smoothing_curve(self) -> float:
        ...
    @property
    def smoothing_factor(self) -> float:
        ...
    @property
    def stop_tokens(self) -> list[int]:
        ...
    @property
    def temp_exponent(self) -> float:
        ...
    @property
    def temperature(self) -> float:
        ...
    @property
    def temperature_last(self) -> bool:
        ...
    @property
    def tfs(self) -> float:
        ...
    @property
    def top_a(self) -> float:
        ...
    @property
    def top_k(self) -> int:
        ...
    @property
    def top_logprobs(self) -> int:
        ...
    @property
    def top_p(self) -> float:
        ...
    @property
    def typical(self) -> float:
        ...
    @property
    def xtc_probability(self) -> float:
        ...
    @property
    def xtc_threshold(self) -> float:
        ...
class Sampler:
    """
    One job's sampler: settings + resolved seed + step counter.
    """
    @staticmethod
    def uniform(seed: typing.SupportsInt | typing.SupportsIndex, step: typing.SupportsInt | typing.SupportsIndex, stream: typing.SupportsInt | typing.SupportsIndex = 0) -> float:
        """
        The job RNG's draw in [0, 1) at (seed, step); stream 0 = the token draw, 1 = XTC's coin.
        """
    def __init__(self, settings: SamplerSettings) -> None:
        ...
    def probs(self, logits: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], context: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], generated: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []) -> numpy.typing.NDArray[numpy.float64]:
        """
        The final distribution sample() would draw from, float64 [vocab]; does not advance step.
        """
    def sample(self, logits: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], context: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], generated: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []) -> tuple[int, float, typing.Any]:
        """
        Sample one token: -> (token, logprob, [(id, logprob), ...]); advances step by one.
        """
    @property
    def mirostat_mu(self) -> float | None:
        """
        Mirostat's mu for the next sample (None when mirostat is off).
        """
    @property
    def seed(self) -> int:
        ...
    @property
    def settings(self) -> SamplerSettings:
        ...
    @property
    def step(self) -> int:
        ...
    @step.setter
    def step(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class Engine:
    """
    The batching engine over one paged KV cache (see cpp/engine/engine.h).
    """
    def __init__(self, model: Model, *, cache_tokens: typing.SupportsInt | typing.SupportsIndex = 16384, page_size: typing.SupportsInt | typing.SupportsIndex = 256, max_batch_tokens: typing.SupportsInt | typing.SupportsIndex = 2048, max_jobs: typing.SupportsInt | typing.SupportsIndex = 0, aging_steps: typing.SupportsInt | typing.SupportsIndex = 16, prefix_cache: bool = True, cache_type: str = 'auto', draft_model: Model | None = None, draft_tokens: typing.SupportsInt | typing.SupportsIndex = 4, ngram_draft: bool = False, ngram_sizes: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [4, 3, 2]) -> None:
        ...
    def cancel(self, job_id: typing.SupportsInt | typing.SupportsIndex, reason: str = 'cancelled') -> bool:
        ...
    def clear_prefix_cache(self) -> int:
        ...
    def job_pages(
        self, job_id: typing.SupportsInt | typing.SupportsIndex, group: typing.SupportsInt | typing.SupportsIndex = 0
    ) -> list[int]:
        ...
    def pages_needed(self, n_tokens: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def cache_tokens_needed(self, n_tokens: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def job_tokens(self, job_id: typing.SupportsInt | typing.SupportsIndex) -> list[int]:
        ...
    def page_refcount(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def rewind(self, job_id: typing.SupportsInt | typing.SupportsIndex, keep: typing.SupportsInt | typing.SupportsIndex, ban: typing.SupportsInt | typing.SupportsIndex = -1) -> bool:
        """
        Take back a job's generated tokens from index `keep` on and ban `ban` there (see engine.h).
        """
    def set_draft_masks(self, fn: collections.abc.Callable[[typing.SupportsInt | typing.SupportsIndex, collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]], collections.abc.Sequence[collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]]] | None) -> None:
        """
        fn(job_id, drafts) -> masks after each accepted draft: constrained jobs speculate (engine.h DraftMaskFn); None: they do not. Before the first submit.
        """
    def set_token_mask(self, job_id: typing.SupportsInt | typing.SupportsIndex, mask: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> bool:
        """
        Replace a job's allowed-token bitmask (uint32 words; empty lifts it); see engine.h.
        """
    def stats(self) -> dict:
        ...
    def step(self, spec_counts: bool = False) -> list:
        """
        One engine step: event tuples (job_id, token, logprob, top, finished, finish_reason, error), with the job's (spec_proposed, spec_accepted) appended when spec_counts.
        """
    def submit(self, prompt: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], *, max_new_tokens: typing.SupportsInt | typing.SupportsIndex = 256, stop_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], sampler: SamplerSettings = ..., priority: typing.SupportsInt | typing.SupportsIndex = 0, token_mask: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], max_rewinds: typing.SupportsInt | typing.SupportsIndex = 16, speculate: bool = True) -> int:
        ...
    @property
    def bytes_per_token(self) -> int:
        ...
    @property
    def cache_type(self) -> str:
        ...
    @property
    def idle(self) -> bool:
        ...
    @property
    def n_pages(self) -> int:
        ...
    @property
    def page_size(self) -> int:
        ...
def build_info() -> dict:
    """
    What this build holds: cpu_isa (in use), cpu_isa_best, cpu_isas_supported / cpu_isas_compiled, native (-march=native), cuda (backend compiled), cuda_archs (SM versions of the device code), compiler.
    """
def cpu_isa() -> typing.Literal['baseline', 'avx2', 'avx512']:
    """
    The vector ISA the CPU kernels run with now: 'baseline', 'avx2' or 'avx512' (backend/cpu/isa.h).
    """
def set_cpu_isa(isa: typing.Literal['baseline', 'avx2', 'avx512']) -> None:
    """
    Force the CPU kernels' ISA ('baseline', 'avx2', 'avx512'; UnsupportedError if this CPU or build lacks it), for tests and benchmarks; the default is the best this CPU supports.
    """
def cpu_num_threads() -> int:
    """
    Threads of the CPU backend's pool (env EXL2CPP_NUM_THREADS).
    """
def nccl_describe() -> str:
    """
    Loads NCCL if needed; its version and path, e.g. "2.32.3 (/.../libnccl.so.2)" (Unsupported without it).
    """
def nccl_set_library(path: str) -> None:
    """
    Where to look first for libnccl.so.2 (tensor parallel); before the first NCCL use.
    """
def cuda_can_access_peer(device: typing.SupportsInt | typing.SupportsIndex, peer: typing.SupportsInt | typing.SupportsIndex) -> bool:
    """
    Whether GPU `device` can access GPU `peer`'s memory directly (peer copies; else staged through the host).
    """
def cuda_compiled() -> bool:
    """
    Whether this build has the CUDA backend.
    """
def cuda_missing_reason() -> str:
    """
    Why this build has no CUDA backend, as recorded when it was configured ("" when it has one).
    """
def require_cuda_backend(what: str) -> None:
    """
    Raise UnsupportedError naming `what`, why this build has no CUDA backend and how to rebuild; a no-op on a CUDA build.
    """
def engine_cache_tokens(
    model: Model,
    n_tokens: typing.SupportsInt | typing.SupportsIndex,
    page_size: typing.SupportsInt | typing.SupportsIndex = 256,
    max_batch_tokens: typing.SupportsInt | typing.SupportsIndex = 2048,
) -> int:
    """Cache tokens (of every layer) an engine job of n_tokens positions holds at most (engine.h job_cache_tokens): less than n_tokens for a model with sliding-window layers."""
def cuda_device_count() -> int:
    """
    Number of CUDA devices (0 without CUDA).
    """
def cuda_device_name(index: typing.SupportsInt | typing.SupportsIndex = 0) -> str:
    """
    Name of CUDA device `index` (InvalidArgument when it is not visible).
    """
def cuda_graph_stats() -> dict:
    """
    Process-wide CUDA counters: graphs captured, graph launches, failed captures (those steps ran eagerly) and cudaMalloc calls made by exl2cpp (a warmed-up decode loop adds none).
    """
def cuda_mem_info(index: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[int, int]:
    """
    (free, total) bytes of CUDA device `index` (sizes the engine's cache).
    """
def cuda_pdl_enabled(index: typing.SupportsInt | typing.SupportsIndex = 0) -> bool:
    """
    Whether the kernels of a step on CUDA device `index` launch as programmatic dependents (PDL, cuda/pdl.cuh): sm_90+ and option pdl / cuda_set_pdl allow it..
    """
def cuda_set_pdl(enabled: typing.Any) -> None:
    """
    Tests: turn programmatic dependent launch on (True, where supported) or off (False) for later launches, or None to follow option pdl again. CUDA graphs already captured keep their edges: use a fresh model.
    """
def decoder_names(folder: str) -> dict:
    """
    Where the architecture of <folder>/config.json finds its tensors (DecoderSpec::names): embed and final_norm tensor names, the layers prefix ("model.layers.": layer i is <layers><i>.), the head linear prefix, and unused_prefixes (parts present in the file but not run, such as a vision tower).
    """
def dump_json(text: str) -> str:
    """
    Parse then re-serialize JSON text compactly (tests the writer).
    """
def exl2_dequantize(tensors: dict, prescale: typing.SupportsFloat | typing.SupportsIndex = 1.0, in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1) -> numpy.ndarray:
    """
    Bit-exact ExLlamaV2 dequantization: float16 W [in, out] in original input order (HF weight = W.T).
    """
def exl2_linear_bench(path: str, prefix: str, rows: typing.SupportsInt | typing.SupportsIndex = 1, iters: typing.SupportsInt | typing.SupportsIndex = 50, device: str = 'cuda', threshold: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
    """
    Seconds per forward of one EXL2 linear on a CUDA device for `rows` rows of random f16 x (CUDA events,
    mean over iters after 3 warm-ups), plus in/out features, nbytes, bits_per_weight, bits_desc.
    """
def exl2_linear_bench_group(paths: collections.abc.Sequence[str], prefixes: collections.abc.Sequence[str], rows: typing.SupportsInt | typing.SupportsIndex = 1, iters: typing.SupportsInt | typing.SupportsIndex = 50, device: str = 'cuda', group: bool = True) -> dict:
    """
    Seconds per call of the EXL2 linears prefixes[i] of paths[i] (one x of `rows` random f16 rows shared by all)
    on a CUDA device: group True through forward_group (one launch where it qualifies), False one forward() each
    (CUDA events, mean over iters after 3 warm-ups); dict seconds, grouped (whether the single launch ran).
    """
def exl2_linear_forward(path: str, prefix: str, x: numpy.ndarray, device: str = 'cuda', in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1, threshold: typing.SupportsInt | typing.SupportsIndex = -1) -> numpy.ndarray:
    """
    Load one EXL2 linear from a .safetensors file or model folder onto `device` and return
    y = forward(x) as float32 [n, out]; x float16 or float32 [n, in] (the activation dtype). On CUDA,
    threshold >= 0 forces the fused-kernel row limit for this call (rows <= threshold: fused GEMV,
    else dequantize + cuBLAS). For tests and tools.
    """
def exl2_linear_forward_fused(path: str, prefixes: collections.abc.Sequence[str], src: numpy.ndarray, out_features: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], device: str = 'cuda', prologue: str = 'none', norm_w: numpy.ndarray | None = None, norm_dtype: str = '', eps: typing.SupportsFloat = 1e-05, up: numpy.ndarray | None = None, y: numpy.ndarray | None = None, fused: bool = True) -> tuple:
    """
    Load the EXL2 linears `prefixes` of one .safetensors file onto `device` and run linear::forward_fused (fused
    True) or forward_composed on src (float16 or float32 [n, in]): prologue 'none', 'rms_norm' (norm_w [in], cast
    to norm_dtype 'f32'/'f16'/'bf16' when given, eps) or 'silu_mul' (up like src); y given ([n, out], src's dtype,
    one layer): the product is added into it. Returns (list of float32 [n, out_i], whether the fused launch ran,
    src afterwards as float32). For tests.
    """
def exl2_linear_forward_group(path: str, prefixes: collections.abc.Sequence[str], x: numpy.ndarray, out_features: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], device: str = 'cuda', group: bool = True) -> tuple:
    """
    Load the EXL2 linears `prefixes` (out_features each) of one .safetensors file onto `device` and apply them all
    to x (float16 or float32 [n, in]): group True through forward_group (one launch where it qualifies), False
    through forward() on each. Returns (list of float32 [n, out_i], whether the single launch ran). For tests.
    """
def exl2_linear_load(path: str, prefix: str, in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1, x: typing.Any = None) -> dict:
    """
    Load one EXL2 linear through the Linear layer (CPU) from a .safetensors file or model folder: dict with
    kind, in/out features, nbytes, bits_per_weight, bits_desc, weight_f32 [out, in] and, given x f32
    [n, in], y = forward(x) [n, out]. For tests and tools.
    """
def exl2_pack(codes: typing.Annotated[numpy.typing.ArrayLike, numpy.uint8], bits_per_group: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], group_rows: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], scale_nibbles: typing.Annotated[numpy.typing.ArrayLike, numpy.uint8], q_scale_max: numpy.ndarray, perm: typing.Annotated[numpy.typing.ArrayLike, numpy.int32], out_features: typing.SupportsInt | typing.SupportsIndex) -> dict:
    """
    Pack codes uint8 [in, out] (PACKED row order), per-group bits and input rows (storage order, bits
    non-increasing), scale nibbles uint8 [G, out], q_scale_max float16 [G] and perm int [in] (original
    feature of packed row k) into the exact on-disk EXL2 tensors: dict q_weight, q_scale, q_scale_max,
    q_groups, q_invperm.
    """
def exl2_unpack(tensors: dict, in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1) -> dict:
    """
    Unpack one EXL2 linear: dict with codes uint8 [in, out] (PACKED row order: row k is input feature
    perm[k]), groups int64 [G, 2] (bits, input rows), scales uint8 [G, out] (stored nibbles 0..15),
    q_scale_max float16 [G], perm int32 [in], plus the layout keys of exl2_validate.
    """
def exl2_validate(tensors: dict, in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1) -> dict:
    """
    Validate one EXL2 linear's tensors (dict of arrays); raises ModelFormatError naming the tensor.
    Returns the layout: in/out features, out_pad, bits_per_group, group_rows, qrow_start, total_bits,
    bits_per_weight and bits_desc (ExLlamaV2's accounting).
    """
def gptq_hessian(x: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], device: str = 'cpu') -> numpy.ndarray:
    """
    x^T x (float32 [in, in]) of x float32 [tokens, in], fp32 accumulation, on 'cpu' or 'cuda[:n]'.
    """
def gptq_quantize(weight: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], u: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], groups: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex]], device: str = 'cpu') -> dict:
    """
    GPTQ of one linear (cpp/quant/gptq.h): codes, scale_nibbles, q_scale_max, weight (dequantized, packed row order).
    """
def kv_rotate(x: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], inverse: bool = False) -> numpy.typing.NDArray[numpy.float32]:
    """
    R x (or R^-1 x) on each row: the quantized cache's rotation.
    """
def load_config(model_dir: str) -> dict:
    """
    Parsed ModelConfig of <model_dir>/config.json as a dict.
    """
def numpy_roundtrip(array: numpy.ndarray, dtype: str = '') -> numpy.ndarray:
    """
    from_numpy then to_numpy (tests the Tensor <-> NumPy bridge).
    """
def op_add(a: numpy.ndarray, b: numpy.ndarray, device: str = 'cpu', out_alias: str = '') -> numpy.ndarray:
    ...
def op_argmax_logprob(logits: numpy.ndarray, device: str = 'cpu') -> tuple:
    """
    (index i32 [rows], logprob f32 [rows]): ops::argmax_logprob.
    """
def op_attention_paged(q: numpy.ndarray, k_pages: numpy.ndarray, v_pages: numpy.ndarray, positions: numpy.ndarray, seq_of_token: numpy.ndarray, page_table: numpy.ndarray, scale: typing.SupportsFloat | typing.SupportsIndex, device: str = 'cpu', n_decode: typing.SupportsInt | typing.SupportsIndex | None = None, window: typing.SupportsInt | typing.SupportsIndex = 0, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0) -> numpy.ndarray:
    ...
def op_attention_paged_q(q: numpy.ndarray, k_q: numpy.ndarray, k_s: numpy.ndarray, v_q: numpy.ndarray, v_s: numpy.ndarray, bits: typing.SupportsInt | typing.SupportsIndex, positions: numpy.ndarray, seq_of_token: numpy.ndarray, page_table: numpy.ndarray, scale: typing.SupportsFloat | typing.SupportsIndex, device: str = 'cpu', k_mean: numpy.ndarray | None = None, rope: numpy.ndarray | None = None, k_sink: numpy.ndarray | None = None, v_sink: numpy.ndarray | None = None, window: typing.SupportsInt | typing.SupportsIndex = 0, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0) -> numpy.ndarray:
    ...
def op_attention_spans(seq_of_token: numpy.ndarray) -> list:
    """
    The attention calls a model step makes for this row layout (ops::attention_spans): [(begin, end, n_decode)].
    """
def op_bench_matmul_nt(n: typing.SupportsInt | typing.SupportsIndex, in_features: typing.SupportsInt | typing.SupportsIndex, out_features: typing.SupportsInt | typing.SupportsIndex, w_dtype: str = 'f16', act: str = 'f32', reps: typing.SupportsInt | typing.SupportsIndex = 3, device: str = 'cpu') -> float:
    ...
def op_convert(src: numpy.ndarray, dtype: str, device: str = 'cpu', src_dtype: str = '') -> numpy.ndarray:
    ...
def op_embedding(ids: numpy.ndarray, table: numpy.ndarray, act: str = 'f32', device: str = 'cpu', table_dtype: str = '') -> numpy.ndarray:
    ...
def op_gather_rows(x: numpy.ndarray, idx: numpy.ndarray, device: str = 'cpu') -> numpy.ndarray:
    ...
def op_kv_write(k: numpy.ndarray, v: numpy.ndarray, k_pages: numpy.ndarray, v_pages: numpy.ndarray, positions: numpy.ndarray, seq_of_token: numpy.ndarray, page_table: numpy.ndarray, device: str = 'cpu') -> tuple[numpy.ndarray, numpy.ndarray]:
    ...
def op_kv_write_q(k: numpy.ndarray, v: numpy.ndarray, k_q: numpy.ndarray, k_s: numpy.ndarray, v_q: numpy.ndarray, v_s: numpy.ndarray, bits: typing.SupportsInt | typing.SupportsIndex, positions: numpy.ndarray, seq_of_token: numpy.ndarray, page_table: numpy.ndarray, device: str = 'cpu', k_mean: numpy.ndarray | None = None, rope: numpy.ndarray | None = None, k_sink: numpy.ndarray | None = None, v_sink: numpy.ndarray | None = None) -> tuple:
    ...
def op_matmul_nt(x: numpy.ndarray, w: numpy.ndarray, bias: numpy.ndarray | None = None, device: str = 'cpu', w_dtype: str = '') -> numpy.ndarray:
    ...
def op_rms_norm(x: numpy.ndarray, w: numpy.ndarray, eps: typing.SupportsFloat | typing.SupportsIndex, device: str = 'cpu', w_dtype: str = '', inplace: bool = False) -> numpy.ndarray:
    ...
def op_add_rms_norm(h: numpy.ndarray, r: numpy.ndarray, w: numpy.ndarray, eps: typing.SupportsFloat | typing.SupportsIndex, device: str = 'cpu', out_is_r: bool = False) -> tuple:
    ...
def op_rope_qk(q: numpy.ndarray, k: numpy.ndarray, positions: numpy.ndarray, cos_sin: numpy.ndarray, device: str = 'cpu') -> tuple:
    ...
def op_rope(x: numpy.ndarray, positions: numpy.ndarray, cos_sin: numpy.ndarray, device: str = 'cpu') -> numpy.ndarray:
    ...
def op_logit_kl(z: numpy.ndarray, d: numpy.ndarray, device: str = 'cpu') -> numpy.ndarray:
    ...
def op_sample_logprob(logits: numpy.ndarray, temperature: collections.abc.Sequence[typing.SupportsFloat], top_k: collections.abc.Sequence[typing.SupportsInt], top_p: collections.abc.Sequence[typing.SupportsFloat], min_p: collections.abc.Sequence[typing.SupportsFloat], u: collections.abc.Sequence[typing.SupportsFloat], device: str = 'cpu') -> tuple:
    """
    (index i32 [rows], logprob f32 [rows]): ops::sample_logprob with one (temperature, top_k, top_p, min_p, u) per row.
    """
def op_silu_mul(gate: numpy.ndarray, up: numpy.ndarray, device: str = 'cpu', out_alias: str = '') -> numpy.ndarray:
    ...
def op_gelu_tanh_mul(gate: numpy.ndarray, up: numpy.ndarray, device: str = 'cpu', out_alias: str = '') -> numpy.ndarray:
    ...
def op_layer_norm(x: numpy.ndarray, w: numpy.ndarray, eps: typing.SupportsFloat | typing.SupportsIndex, device: str = 'cpu', w_dtype: str = '', inplace: bool = False) -> numpy.ndarray:
    ...
def op_scale(x: numpy.ndarray, s: typing.SupportsFloat | typing.SupportsIndex, cap: typing.SupportsFloat | typing.SupportsIndex = 0.0, device: str = 'cpu', inplace: bool = False) -> numpy.ndarray:
    ...
def parse_json(text: str) -> typing.Any:
    """
    Parse JSON text (str or UTF-8 bytes) strictly into Python objects.
    """
def read_safetensors(path: str) -> dict:
    """
    Read every tensor of a .safetensors file or model folder (copies). bf16 comes back as uint16 bits.
    """
def read_tensor(path: str, name: str, shape: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None, dtypes: collections.abc.Sequence[str] = []) -> numpy.ndarray:
    """
    One tensor (copied), checked against `shape` (-1: any) and `dtypes` when given (TensorMap::get_checked).
    """
def safetensors_names(path: str) -> list[str]:
    """
    Sorted tensor names of a .safetensors file or model folder.
    """
def sampler_probs(settings: SamplerSettings, logits: typing.Annotated[numpy.typing.ArrayLike, numpy.float32], context: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = [], generated: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []) -> numpy.typing.NDArray[numpy.float64]:
    """
    Final sampling distribution (float64 [vocab], zero outside the support) for these settings and logits.
    """
def op_moe_route(logits: numpy.ndarray, k: typing.SupportsInt, renormalize: bool, device: str = 'cpu') -> tuple:
    """
    ops::moe_route: (ids int32 [rows, k], weights float32 [rows, k]).
    """
def op_moe_group(ids: numpy.ndarray, n_experts: typing.SupportsInt, device: str = 'cpu') -> tuple:
    """
    ops::moe_group: (offsets [E + 1], perm [P], inv [P], active [E + 1]), all int32.
    """
def op_moe_combine(expert_out: numpy.ndarray, weights: numpy.ndarray, inv: numpy.ndarray, shared: numpy.ndarray | None = None, shared_gate: numpy.ndarray | None = None, out: numpy.ndarray | None = None, hidden: typing.SupportsInt = 0, device: str = 'cpu') -> numpy.ndarray:
    """
    ops::moe_combine; given out, the result is added into (a copy of) it (add = true), else hidden sizes out.
    """
def moe_experts_forward(path: str, prefixes: collections.abc.Sequence[str], x: numpy.ndarray, ids: numpy.ndarray, in_features: typing.SupportsInt, out_features: typing.SupportsInt, gather: bool = True, device: str = 'cpu', repeats: typing.SupportsInt = 1) -> dict:
    """
    MoeExperts::forward on ids grouped on `device`: dict y, path, bytes_read, weight_bytes.
    """
def moe_graph_replay(path: str, prefixes: collections.abc.Sequence[str], x: numpy.ndarray, logits: collections.abc.Sequence[numpy.ndarray], k: typing.SupportsInt, in_features: typing.SupportsInt, out_features: typing.SupportsInt, device: str = 'cuda:0') -> tuple:
    """
    route -> group -> experts -> combine captured as one CUDA graph, replayed per logits: (graph outputs, eager outputs).
    """
def moe_experts_bench(path: str, prefixes: collections.abc.Sequence[str], ids: numpy.ndarray, in_features: typing.SupportsInt, out_features: typing.SupportsInt, iters: typing.SupportsInt = 50, device: str = 'cuda:0') -> tuple:
    """
    (seconds per MoeExperts::forward, weight bytes one call streams, path) on a CUDA device.
    """
def get_options() -> dict:
    """
    The runtime options in force (exl2/options.h), as a dict name -> bool / int / str.
    """
def set_options(options: dict) -> None:
    """
    Set some runtime options by name (the others keep their values). InvalidArgumentError naming an unknown
    option or a bad value; nothing changes then.
    """
def default_options() -> dict:
    """
    The options' defaults, as a dict.
    """
def option_registry() -> list:
    """
    Every runtime option: name, type (bool / int / choice), default and allowed values as text, scope, doc.
    """
def environment_settings() -> list:
    """
    The settings that stay environment variables: [(name, doc)].
    """
def exl2_matmul_plan(rows: typing.SupportsInt | typing.SupportsIndex, in_features: typing.SupportsInt | typing.SupportsIndex, out_features: typing.SupportsInt | typing.SupportsIndex, f16: bool = True, n_layers: typing.SupportsInt | typing.SupportsIndex = 1, fused: bool = False, gpu_name: str = 'NVIDIA H200', cc: typing.SupportsInt | typing.SupportsIndex = 90, sm_count: typing.SupportsInt | typing.SupportsIndex = 132, tuning: dict = {}) -> dict:
    """
    The EXL2 matmul planner (pure; ops/exl2_matmul.h) for a layer shape on a described GPU: dict kernel,
    launches [{row0, rows, kernel, m_tile}], slices, chunks_per_slice, tuned_on, tuned, note. tuning: any of
    gemv_max_rows, m32, group, reference, slices, chunks_per_slice.
    """
def exl2_matmul_plan_for_device(index: typing.SupportsInt | typing.SupportsIndex, rows: typing.SupportsInt | typing.SupportsIndex, in_features: typing.SupportsInt | typing.SupportsIndex, out_features: typing.SupportsInt | typing.SupportsIndex, f16: bool = True) -> None:
    """
    The plan ops::exl2_matmul makes on CUDA device `index` under the options in force (see exl2_matmul_plan).
    """
def exl2_matmul_reference(tensors: dict, x: numpy.ndarray, in_features: typing.SupportsInt | typing.SupportsIndex = -1, out_features: typing.SupportsInt | typing.SupportsIndex = -1) -> numpy.ndarray:
    """
    ops::exl2_matmul on the CPU, the reference: y = x @ W + bias for x float32 or float16 [..., in] (y of x's
    dtype), W dequantized bit-exactly, fp32 sums in input order (ops/exl2_matmul.h).
    """
