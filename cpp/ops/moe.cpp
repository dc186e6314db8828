// ops::moe_route / moe_group / moe_combine: argument checks (ops/ops.h) and dispatch to cpu:: or cuda::.
#include <string>
#include <tuple>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void moe_route(const Tensor& logits, int64_t k, bool renormalize, Tensor& ids, Tensor& weights) {
  const char* op = "moe_route";
  detail::check_defined_same_device(op, {{"logits", &logits}, {"ids", &ids}, {"weights", &weights}});
  detail::check_act(op, "logits", logits);
  detail::check_rank(op, "logits", logits, 2);
  const int64_t rows = logits.size(0), n_experts = logits.size(1);
  EXL2_CHECK(n_experts >= 1 && n_experts <= kMoeMaxExperts, op, ": logits must have 1..", kMoeMaxExperts,
             " experts (columns), got ", logits.describe());
  EXL2_CHECK(k >= 1 && k <= n_experts, op, ": k must be in [1, ", n_experts, "] (experts per token), got ", k);
  detail::check_dtype(op, "ids", ids, DType::I32);
  detail::check_shape(op, "ids", ids, {rows, k});
  detail::check_dtype(op, "weights", weights, DType::F32);
  detail::check_shape(op, "weights", weights, {rows, k});
  if (rows == 0) return;
  EXL2_OPS_DISPATCH(logits.device(), moe_route, logits.data(), logits.dtype(), rows, n_experts, k, renormalize,
                    ids.data_as<int32_t>(), weights.data_as<float>());
}

void moe_group(const Tensor& ids, int64_t n_experts, Tensor& offsets, Tensor& perm, Tensor& inv, Tensor& active) {
  const char* op = "moe_group";
  detail::check_defined_same_device(
      op, {{"ids", &ids}, {"offsets", &offsets}, {"perm", &perm}, {"inv", &inv}, {"active", &active}});
  detail::check_dtype(op, "ids", ids, DType::I32);
  detail::check_rank(op, "ids", ids, 2);
  EXL2_CHECK(n_experts >= 1 && n_experts <= kMoeMaxExperts, op, ": n_experts must be in [1, ", kMoeMaxExperts,
             "], got ", n_experts);
  const int64_t n_pairs = ids.numel();
  EXL2_CHECK(n_pairs <= 0x7fffffff, op, ": at most 2^31-1 (row, slot) pairs, got ", n_pairs);
  for (auto [name, t, n] : {std::tuple{"offsets", &offsets, n_experts + 1}, std::tuple{"perm", &perm, n_pairs},
                            std::tuple{"inv", &inv, n_pairs}, std::tuple{"active", &active, n_experts + 1}}) {
    detail::check_dtype(op, name, *t, DType::I32);
    detail::check_shape(op, name, *t, {n});
  }
  detail::check_no_overlap(op, "perm", perm, "inv", inv);
  if (ids.device().is_cpu()) {
    const int32_t* p = ids.data_as<int32_t>();
    for (int64_t i = 0; i < n_pairs; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < n_experts, op, ": ids[", i / ids.size(1), ", ", i % ids.size(1),
                 "] must be an expert in [0, ", n_experts, "), got ", p[i]);
  }
  EXL2_OPS_DISPATCH(ids.device(), moe_group, ids.data_as<int32_t>(), n_pairs, n_experts, offsets.data_as<int32_t>(),
                    perm.data_as<int32_t>(), inv.data_as<int32_t>(), active.data_as<int32_t>());
}

void moe_combine(const Tensor& expert_out, const Tensor& weights, const Tensor& inv, const Tensor& shared,
                 const Tensor& shared_gate, bool add, Tensor& out) {
  const char* op = "moe_combine";
  detail::check_defined_same_device(op,
                                    {{"expert_out", &expert_out}, {"weights", &weights}, {"inv", &inv}, {"out", &out}});
  detail::check_act(op, "out", out);
  detail::check_rank(op, "out", out, 2);
  const int64_t rows = out.size(0), hidden = out.size(1);
  detail::check_dtype(op, "weights", weights, DType::F32);
  detail::check_rank(op, "weights", weights, 2);
  EXL2_CHECK(weights.size(0) == rows, op, ": weights must be [", rows, ", k] (one row per row of out), got ",
             weights.describe());
  const int64_t k = weights.size(1), n_pairs = rows * k;
  detail::check_same_dtype(op, "expert_out", expert_out, "out", out);
  detail::check_shape(op, "expert_out", expert_out, {n_pairs, hidden});
  detail::check_dtype(op, "inv", inv, DType::I32);
  detail::check_shape(op, "inv", inv, {n_pairs});
  EXL2_CHECK(shared.defined() == shared_gate.defined(), op,
             ": shared and shared_gate must be given together (Qwen2-MoE's gated shared expert), got shared ",
             shared.defined() ? "defined" : "undefined", " and shared_gate ",
             shared_gate.defined() ? "defined" : "undefined");
  detail::check_no_overlap(op, "out", out, "expert_out", expert_out);
  detail::check_no_overlap(op, "out", out, "weights", weights);
  detail::check_no_overlap(op, "out", out, "inv", inv);
  if (shared.defined()) {
    detail::check_defined_same_device(op, {{"out", &out}, {"shared", &shared}, {"shared_gate", &shared_gate}});
    detail::check_same_dtype(op, "shared", shared, "out", out);
    detail::check_shape(op, "shared", shared, {rows, hidden});
    EXL2_CHECK(shared_gate.dtype() == DType::F32 || shared_gate.dtype() == out.dtype(), op,
               ": shared_gate must be f32 or out's dtype ", dtype_name(out.dtype()), ", got ", shared_gate.describe());
    detail::check_shape(op, "shared_gate", shared_gate, {rows, 1});
    detail::check_no_overlap(op, "out", out, "shared", shared);
    detail::check_no_overlap(op, "out", out, "shared_gate", shared_gate);
  }
  if (rows == 0 || hidden == 0) return;
  if (inv.device().is_cpu()) {
    const int32_t* p = inv.data_as<int32_t>();
    for (int64_t i = 0; i < n_pairs; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < n_pairs, op, ": inv[", i, "] must be a position in [0, ", n_pairs, "), got ",
                 p[i]);
  }
  EXL2_OPS_DISPATCH(out.device(), moe_combine, expert_out.data(), weights.data_as<float>(), inv.data_as<int32_t>(),
                    shared.defined() ? shared.data() : nullptr, shared.defined() ? shared_gate.data() : nullptr,
                    shared.defined() ? shared_gate.dtype() : DType::F32, rows, k, hidden, add, out.data(), out.dtype());
}

}  // namespace exl2::ops
