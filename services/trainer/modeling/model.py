"""The trainer's model: megatron-core GPTModel built from a Hugging Face config.json.

Covers the Qwen2 / Qwen2.5 / Llama layouts (RMSNorm, SwiGLU, grouped-query attention, RoPE,
optional QKV bias, tied or untied embeddings) and the Qwen2-MoE / Qwen3-MoE mixture-of-experts
layouts (megatron-core's MoE layer: top-k softmax router, per-expert SwiGLU MLPs, Qwen2-MoE's
sigmoid-gated shared expert, Qwen3's q/k RMSNorm). Tensor, pipeline and expert parallel groups
come from megatron-core's parallel_state over torch.distributed: gloo on CPU, NCCL on CUDA, HCCL on NPU.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # RMSNorm on each head's query and key
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelLayout:
    """The shape of a decoder-only model, read from its Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    qk_layernorm: bool = False  # RMSNorm on each head's query and key before RoPE (Qwen3)
    num_experts: int = 0  # routed experts per MoE layer; 0: a dense model
    moe_topk: int = 0  # experts each token is routed to (num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # each routed expert's SwiGLU width (moe_intermediate_size)
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE's shared expert width, gated by a sigmoid; 0: none
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # load-balancing loss coefficient

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dir(cls, hf_dir: str | pathlib.Path) -> "ModelLayout":
        """Reads `hf_dir/config.json`; raises ValueError for an architecture this trainer does not build."""
        cfg = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures: {arch!r} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        # What this GPTModel does not build would be silently wrong logits: refuse it by name.
        rope_type = rope.get("rope_type") or (cfg.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"config.json rope_parameters.rope_type: {rope_type!r} is not supported (only 'default' RoPE)")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window: sliding-window attention is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act: {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")
        moe = _moe_fields(cfg, arch) if arch in MOE_ARCHITECTURES else {}
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg["max_position_embeddings"],
            # Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias is false; Llama and Qwen3 only with attention_bias.
            qkv_bias=(arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))
                      or bool(cfg.get("attention_bias", False))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_layernorm=arch in QK_NORM_ARCHITECTURES,
            **moe,
        )

    def check_parallel(self, tp: int, pp: int, cp: int = 1, cp_algo: str = "megatron_cp_algo", ep: int = 1, vpp: int = 1,
                       ulysses: int = 1) -> None:
        """Raises ValueError naming the key when the model cannot be split tp x pp (x cp) ways, each stage into vpp
        chunks, its experts ep ways; `ulysses` is hybrid_cp_algo's Ulysses degree within CP."""
        widths = [("num_key_value_heads", self.num_key_value_heads), ("num_attention_heads", self.num_attention_heads),
                  ("vocab_size", self.vocab_size)]
        if self.is_moe:
            widths += [("moe_intermediate_size", self.moe_ffn_hidden_size)]
            widths += [("shared_expert_intermediate_size", self.shared_expert_ffn_hidden_size)] if self.shared_expert_ffn_hidden_size else []
        else:
            widths += [("intermediate_size", self.ffn_hidden_size)]
        for what, size in widths:
            if size % tp:
                raise ValueError(f"megatron_training.tensor_model_parallel_size: {tp} does not divide the model's {what} {size}")
        if self.num_layers % pp:
            raise ValueError(f"megatron_training.pipeline_model_parallel_size: {pp} does not divide num_hidden_layers {self.num_layers}")
        if self.num_layers % (pp * vpp):
            raise ValueError(f"megatron_training.virtual_pipeline_model_parallel_size: {vpp} chunks on each of {pp} stages do not "
                             f"divide num_hidden_layers {self.num_layers} (megatron needs it a multiple of PP x VPP = {pp * vpp})")
        if cp > 1 and cp_algo == "ulysses_cp_algo" and (self.num_attention_heads // tp) % cp:
            raise ValueError(f"megatron_training.context_parallel_size: {cp} does not divide the {self.num_attention_heads // tp} "
                             f"attention heads of a tensor-parallel rank (num_attention_heads {self.num_attention_heads} / TP {tp}); "
                             "ulysses_cp_algo splits them over the CP ranks (megatron_cp_algo does not)")
        if cp > 1 and cp_algo == "hybrid_cp_algo" and (self.num_attention_heads // tp) % ulysses:
            raise ValueError(f"megatron_training.ulysses_degree_in_cp: {ulysses} does not divide the {self.num_attention_heads // tp} "
                             f"attention heads of a tensor-parallel rank (num_attention_heads {self.num_attention_heads} / TP {tp}); "
                             "hybrid_cp_algo splits them over each group of that many CP ranks")
        if ep > 1 and not self.is_moe:
            raise ValueError(f"megatron_training.expert_model_parallel_size: {ep} needs a mixture-of-experts model ({self.architecture} has no experts)")
        if self.is_moe and self.num_experts % ep:
            raise ValueError(f"megatron_training.expert_model_parallel_size: {ep} does not divide the model's num_experts {self.num_experts}")


def _moe_fields(cfg: dict, arch: str) -> dict:
    """ModelLayout's MoE fields from a Qwen2-MoE / Qwen3-MoE config.json; refuses layouts build_model does not make."""
    # Every layer is an MoE layer here: dense layers between them would be a per-layer MLP kind this converter does not map.
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"config.json decoder_sparse_step: {cfg['decoder_sparse_step']!r} is not supported (only 1: every layer MoE)")
    if cfg.get("mlp_only_layers"):
        raise ValueError(f"config.json mlp_only_layers: {cfg['mlp_only_layers']!r} is not supported (dense layers in an MoE model)")
    shared = (cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        moe_topk=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=shared,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compute_device() -> torch.device:
    """Where this rank computes: its CUDA device, its NPU (torch_npu), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def cpu_threads() -> int:
    """Torch threads for a trainer on the CPU: OMP_NUM_THREADS when set, else every core this process may use but one.

    Each torch operator is an OpenMP parallel region that ends when its slowest thread ends. With a
    thread on every core, any other process that wakes (rollout and reward workers polling the dock,
    Redis, the vLLM engine) preempts one thread and the whole operator waits for it. Measured on
    2 cores next to one busy process: a tiny-config step took 1.5 s on 2 threads, 0.22 s on 1.
    """
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) - 1)


def default_backend() -> str:
    """nccl with CUDA, hccl with torch_npu, gloo otherwise."""
    if torch.cuda.is_available():
        return "nccl"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "hccl"
    return "gloo"


def init_parallel(tp: int = 1, pp: int = 1, backend: str = "auto", seed: int = 1234, cp: int = 1, ep: int = 1,
                  vpp: int = 1, ulysses: int = 1) -> None:
    """Initialises torch.distributed (from torchrun's env, or a single local process) and megatron's groups.

    `ep` splits each MoE layer's experts over that many ranks, carved out of the data-parallel ones; `vpp` > 1
    gives each pipeline stage that many model chunks (megatron's interleaved schedule); `ulysses` > 1 (hybrid_cp_algo's
    ulysses_degree_in_cp) makes megatron's hierarchical CP groups [ulysses, cp / ulysses] as well.

    Applies the CPU shims when there is no accelerator. Safe to call twice with the same sizes.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.modeling.cpu_shims import apply_cpu_shims

    if ulysses > 1 and (cp % ulysses or cp // ulysses < 2):
        raise ValueError(f"megatron_training.ulysses_degree_in_cp: {ulysses} must divide context_parallel_size {cp} into "
                         "Ulysses groups and a ring of at least 2 each")
    on_cpu = apply_cpu_shims()
    if not dist.is_initialized():
        backend = default_backend() if backend == "auto" else backend
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # Each rank binds its own device before the communicator is created on it.
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        elif backend == "hccl":
            torch.npu.set_device(local_rank)
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
                 virtual_pipeline_size(), ulysses_degree())
        if sizes != (tp, pp, cp, ep, vpp, ulysses):
            raise RuntimeError("init_parallel: already initialised with other tensor/pipeline/context/expert parallel sizes")
        return
    if dist.get_world_size() % (tp * pp * cp):
        raise ValueError(f"megatron_training: world size {dist.get_world_size()} is not a multiple of TP {tp} x PP {pp} x CP {cp}")
    if dist.get_world_size() % (tp * pp * ep):
        raise ValueError(f"megatron_training.expert_model_parallel_size: world size {dist.get_world_size()} is not a multiple of "
                         f"TP {tp} x PP {pp} x EP {ep}")
    # Data-parallel groups leave the CP ranks out (they hold the same samples); gradients are reduced over DP x CP.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             hierarchical_context_parallel_sizes=[ulysses, cp // ulysses] if ulysses > 1 else None)
    torch.manual_seed(seed)
    if not on_cpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def ulysses_degree() -> int:
    """CP ranks of one Ulysses group under hybrid_cp_algo (init_parallel's `ulysses`): 1 without hierarchical CP groups."""
    from services.trainer.modeling.context_parallel import hybrid_groups

    groups = hybrid_groups()
    return groups[0].size() if groups else 1


def virtual_pipeline_size() -> int:
    """Model chunks per pipeline stage (init_parallel's `vpp`): 1 without the interleaved schedule."""
    from megatron.core import parallel_state

    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def destroy_parallel() -> None:
    """Tears down megatron's groups and the process group (tests, clean exits)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # megatron-core 0.16.1's teardown leaves the hierarchical CP groups set; a later init without them must not see them.
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    if dist.is_initialized():
        dist.destroy_process_group()


def transformer_config(layout: ModelLayout, tp: int, pp: int, dtype: torch.dtype = torch.float32, cp: int = 1,
                       cp_algo: str = "megatron_cp_algo", ep: int = 1, vpp: int = 1, routing_replay: bool = False,
                       ulysses: int = 1):
    """megatron-core TransformerConfig for `layout`, with CUDA-only fusions off (they are no faster on CPU).

    `routing_replay` gives each MoE router megatron's RouterReplay (routing_replay.py drives it).

    `cp_algo` (MindSpeed-RL's context_parallel_algo) becomes megatron's cp_comm_type, which the core attention reads;
    hybrid_cp_algo's groups are megatron's hierarchical_context_parallel_sizes [ulysses, cp / ulysses].
    """
    from services.trainer.modeling.context_parallel import CP_ALGOS

    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_key_value_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        cp_comm_type=CP_ALGOS[cp_algo] if cp > 1 else None,
        hierarchical_context_parallel_sizes=[ulysses, cp // ulysses] if cp > 1 and cp_algo == "hybrid_cp_algo" else None,
        expert_model_parallel_size=ep,
        qk_layernorm=layout.qk_layernorm,
        **(_moe_config(layout, routing_replay) if layout.is_moe else {}),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Micro-batches differ in length: the 1F1B schedule sends each tensor's shape first. The interleaved one
        # sends one fixed shape (pipeline.py pads every micro-batch to it).
        variable_seq_lengths=pp > 1 and vpp == 1,
        # Interleaved with PP 2, a stage's next and previous stage are one rank, and a batched exchange can match the
        # activation sent one way with the gradient sent the same way (same shape: silently swapped). Megatron's
        # unbatched exchange orders them by rank parity and puts the two directions on separate groups.
        batch_p2p_comm=vpp == 1,
        # megatron-core refuses variable lengths beside its default MoE dispatcher, even in a dense model.
        moe_token_dispatcher_type="alltoall",
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def _moe_config(layout: ModelLayout, routing_replay: bool) -> dict:
    """TransformerConfig's MoE fields: Hugging Face's routing is softmax over all experts, top-k, then renormalised
    when norm_topk_prob; megatron's softmax over the top-k logits is that renormalised form, its pre-softmax the other."""
    return dict(
        num_moe_experts=layout.num_experts,
        moe_router_topk=layout.moe_topk,
        moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
        moe_router_pre_softmax=not layout.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=layout.router_aux_loss_coef,
        moe_shared_expert_intermediate_size=layout.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=bool(layout.shared_expert_ffn_hidden_size),
        moe_grouped_gemm=False,  # SequentialMLP: one plain MLP per local expert (grouped GEMM needs CUDA kernels)
        moe_enable_routing_replay=routing_replay,
    )


class ModelChunks(torch.nn.ModuleList):
    """A pipeline stage's model chunks under the interleaved schedule (virtual pipeline), in chunk order.

    Its state dict names chunk v's tensors `v.<megatron name>`, the names checkpoint_convert and the weight gather use.
    """

    @property
    def config(self):
        """The TransformerConfig every chunk was built from (one object)."""
        return self[0].config


def model_chunks(model) -> list:
    """The GPTModels of `model`: its chunks under the interleaved schedule, else the model alone."""
    return list(model) if isinstance(model, ModelChunks) else [model]


def build_model(layout: ModelLayout, dtype: torch.dtype = torch.float32, cp_algo: str = "megatron_cp_algo",
                routing_replay: bool = False):
    """A GPTModel for this rank's tensor/pipeline shard (init_parallel first); logits come out as this TP rank's vocabulary slice.

    With context parallel (init_parallel's `cp`) its attention exchanges sequence shares by `cp_algo`
    (ulysses_cp_algo | megatron_cp_algo | hybrid_cp_algo, whose groups init_parallel's `ulysses` made). With a
    virtual pipeline (init_parallel's `vpp`) a ModelChunks of vpp GPTModels, chunk v holding megatron's global layers
    (v x PP + stage) x L / (PP x VPP) onwards (`get_transformer_layer_offset`), the embedding in stage 0's chunk 0,
    the head in the last stage's last chunk.
    `routing_replay` (rl_config.routing_replay) needs an MoE layout.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from services.trainer.modeling.attention import SDPACoreAttention
    from services.trainer.modeling.cpu_shims import accelerator_present, apply_moe_cpu_shims

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    vpp = virtual_pipeline_size()
    ulysses = ulysses_degree()
    if cp > 1 and cp_algo == "hybrid_cp_algo" and ulysses == 1:
        raise ValueError("megatron_training.ulysses_degree_in_cp: hybrid_cp_algo needs its Ulysses and ring groups, which "
                         "init_parallel(ulysses=ulysses_degree_in_cp) makes; it was called without them")
    layout.check_parallel(tp, pp, cp, cp_algo, ep, vpp, ulysses)
    if routing_replay and not layout.is_moe:
        raise ValueError("rl_config.routing_replay: the model has no MoE layers, so there is no routing to replay")
    if pp > 1 and layout.tie_word_embeddings and not accelerator_present():
        # megatron-core syncs the two copies of a tied embedding with a .cuda() call at construction.
        raise ValueError("megatron_training.pipeline_model_parallel_size: tied embeddings with PP > 1 need an accelerator")
    if layout.is_moe:
        from megatron.core.transformer.moe import moe_utils

        if not moe_utils.HAVE_TE:
            # megatron-core 0.16.1's router GEMM tests `te_general_gemm`, a name it defines only when Transformer Engine imports.
            moe_utils.te_general_gemm = None
        apply_moe_cpu_shims()
    spec = get_gpt_layer_local_spec(num_experts=layout.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=layout.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention  # every device; packed input too
    config = transformer_config(layout, tp, pp, dtype, cp, cp_algo, ep, vpp, routing_replay, ulysses)

    def chunk(vp_stage: int | None):
        return GPTModel(
            config,
            transformer_layer_spec=spec,
            vocab_size=layout.vocab_size,
            max_sequence_length=layout.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,  # each TP rank keeps its vocabulary slice; log-probs reduce over TP (logprobs.py)
            share_embeddings_and_output_weights=layout.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(layout.rope_theta),
            vp_stage=vp_stage,
        )

    model = chunk(None) if vpp == 1 else ModelChunks(chunk(v) for v in range(vpp))
    return model.to(compute_device())
