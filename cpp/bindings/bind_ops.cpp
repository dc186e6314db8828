// Bindings for the ops area (see bindings.h): every ops:: function as _C.op_<name>(numpy arrays..., device=...)
// returning NumPy arrays, so tests/test_backend_ops.py runs the same cases on "cpu" and "cuda:0".
// bf16 crosses as uint16 raw bits: pass the *_dtype="bf16" argument to mark a uint16 array as bf16.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>

#include "backend/cpu/thread_pool.h"
#include "bindings/bindings.h"
#include "cache/kv_quant.h"
#include "core/device_api.h"
#include "exl2/sample_params.h"
#include "ops/ops.h"

namespace py = pybind11;

namespace exl2 {
namespace {

Tensor arg(const py::array& a, const Device& dev, const std::string& dtype = "") {
  Tensor t = from_numpy(a, dtype);
  return dev.is_cpu() ? t : t.to(dev);
}

DType act_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return DType::F32;
  if (name == "f16" || name == "float16") return DType::F16;
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  EXL2_FAIL(InvalidArgument, "dtype must be \"f32\", \"f16\" or \"bf16\", got \"", name, "\"");
}

}  // namespace

void bind_ops(py::module_& m) {
  m.def("cpu_num_threads", &cpu::num_threads, "Threads of the CPU backend's pool (env EXL2CPP_NUM_THREADS).");

  m.def(
      "op_bench_matmul_nt",
      [](int64_t n, int64_t in, int64_t out, const std::string& w_dtype, const std::string& act, int reps,
         const std::string& device) {
        // Times ops::matmul_nt alone (no NumPy copies) on tensors built here; returns seconds per call.
        const Device dev = Device::parse(device);
        EXL2_CHECK(n > 0 && in > 0 && out > 0 && reps > 0, "op_bench_matmul_nt: sizes and reps must be > 0");
        Tensor x = Tensor::empty({n, in}, DType::F32), w = Tensor::empty({out, in}, DType::F32);
        uint32_t state = 12345;  // xorshift: values in [-0.5, 0.5)
        auto fill = [&](Tensor& t) {
          float* p = t.data_as<float>();
          for (int64_t i = 0; i < t.numel(); ++i) {
            state ^= state << 13, state ^= state >> 17, state ^= state << 5;
            p[i] = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
          }
        };
        fill(x), fill(w);
        x = x.to_dtype(act_dtype(act)).to(dev);
        w = w.to_dtype(act_dtype(w_dtype)).to(dev);
        Tensor y = Tensor::empty({n, out}, x.dtype(), dev);
        py::gil_scoped_release nogil;
        ops::matmul_nt(x, w, Tensor(), y);  // warm-up (thread pool start, page faults)
        if (dev.is_cuda()) device::cuda_synchronize(dev.index);
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) ops::matmul_nt(x, w, Tensor(), y);
        if (dev.is_cuda()) device::cuda_synchronize(dev.index);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
      },
      py::arg("n"), py::arg("in_features"), py::arg("out_features"), py::arg("w_dtype") = "f16", py::arg("act") = "f32",
      py::arg("reps") = 3, py::arg("device") = "cpu");

  m.def(
      "op_embedding",
      [](py::array ids, py::array table, const std::string& act, const std::string& device,
         const std::string& table_dtype) {
        const Device dev = Device::parse(device);
        Tensor ti = arg(ids, dev), tt = arg(table, dev, table_dtype);
        Tensor out = Tensor::empty({ti.dim() ? ti.size(0) : 0, tt.dim() == 2 ? tt.size(1) : 0}, act_dtype(act), dev);
        {
          py::gil_scoped_release nogil;
          ops::embedding(ti, tt, out);
        }
        return to_numpy(out);
      },
      py::arg("ids"), py::arg("table"), py::arg("act") = "f32", py::arg("device") = "cpu", py::arg("table_dtype") = "");

  m.def(
      "op_rms_norm",
      [](py::array x, py::array w, float eps, const std::string& device, const std::string& w_dtype, bool inplace) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev), tw = arg(w, dev, w_dtype);
        Tensor out = inplace ? tx : Tensor::empty(tx.shape(), tx.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::rms_norm(tx, tw, eps, out);
        }
        return to_numpy(out);
      },
      py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("device") = "cpu", py::arg("w_dtype") = "",
      py::arg("inplace") = false);

  m.def(
      "op_layer_norm",
      [](py::array x, py::array w, float eps, const std::string& device, const std::string& w_dtype, bool inplace) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev), tw = arg(w, dev, w_dtype);
        Tensor out = inplace ? tx : Tensor::empty(tx.shape(), tx.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::layer_norm(tx, tw, eps, out);
        }
        return to_numpy(out);
      },
      py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("device") = "cpu", py::arg("w_dtype") = "",
      py::arg("inplace") = false);

  m.def(
      "op_scale",
      [](py::array x, float s, float cap, const std::string& device, bool inplace) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev);
        Tensor out = inplace ? tx : Tensor::empty(tx.shape(), tx.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::scale(tx, s, cap, out);
        }
        return to_numpy(out);
      },
      py::arg("x"), py::arg("s"), py::arg("cap") = 0.0f, py::arg("device") = "cpu", py::arg("inplace") = false);

  m.def(
      "op_add_rms_norm",
      [](py::array h, py::array r, py::array w, float eps, const std::string& device, bool out_is_r) {
        const Device dev = Device::parse(device);
        Tensor th = arg(h, dev), tr = arg(r, dev), tw = arg(w, dev);
        Tensor out = out_is_r ? tr : Tensor::empty(th.shape(), th.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::add_rms_norm(th, tr, tw, eps, out);
        }
        return py::make_tuple(to_numpy(th), to_numpy(out));
      },
      py::arg("h"), py::arg("r"), py::arg("w"), py::arg("eps"), py::arg("device") = "cpu", py::arg("out_is_r") = false,
      "(h + r, rms_norm(h + r)) through ops::add_rms_norm (one kernel on CUDA for f16).");

  m.def(
      "op_rope_qk",
      [](py::array q, py::array k, py::array positions, py::array cos_sin, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tq = arg(q, dev), tk = arg(k, dev), tp = arg(positions, dev), tc = arg(cos_sin, dev);
        {
          py::gil_scoped_release nogil;
          ops::rope_qk(tq, tk, tp, tc);
        }
        return py::make_tuple(to_numpy(tq), to_numpy(tk));
      },
      py::arg("q"), py::arg("k"), py::arg("positions"), py::arg("cos_sin"), py::arg("device") = "cpu");

  m.def(
      "op_rope",
      [](py::array x, py::array positions, py::array cos_sin, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev), tp = arg(positions, dev), tc = arg(cos_sin, dev);
        {
          py::gil_scoped_release nogil;
          ops::rope(tx, tp, tc);
        }
        return to_numpy(tx);
      },
      py::arg("x"), py::arg("positions"), py::arg("cos_sin"), py::arg("device") = "cpu");

  m.def(
      "op_matmul_nt",
      [](py::array x, py::array w, std::optional<py::array> bias, const std::string& device,
         const std::string& w_dtype) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev), tw = arg(w, dev, w_dtype), tb;
        if (bias) tb = arg(*bias, dev);
        Shape ys = tx.shape();
        if (!ys.empty() && tw.dim() == 2) ys.back() = tw.size(0);
        Tensor y = Tensor::empty(ys, tx.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::matmul_nt(tx, tw, tb, y);
        }
        return to_numpy(y);
      },
      py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::arg("device") = "cpu", py::arg("w_dtype") = "");

  m.def(
      "op_silu_mul",
      [](py::array gate, py::array up, const std::string& device, const std::string& out_alias) {
        const Device dev = Device::parse(device);
        Tensor tg = arg(gate, dev), tu = arg(up, dev);
        Tensor out = out_alias == "gate" ? tg : out_alias == "up" ? tu : Tensor::empty(tg.shape(), tg.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::silu_mul(tg, tu, out);
        }
        return to_numpy(out);
      },
      py::arg("gate"), py::arg("up"), py::arg("device") = "cpu", py::arg("out_alias") = "");

  m.def(
      "op_gelu_tanh_mul",
      [](py::array gate, py::array up, const std::string& device, const std::string& out_alias) {
        const Device dev = Device::parse(device);
        Tensor tg = arg(gate, dev), tu = arg(up, dev);
        Tensor out = out_alias == "gate" ? tg : out_alias == "up" ? tu : Tensor::empty(tg.shape(), tg.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::gelu_tanh_mul(tg, tu, out);
        }
        return to_numpy(out);
      },
      py::arg("gate"), py::arg("up"), py::arg("device") = "cpu", py::arg("out_alias") = "");

  m.def(
      "op_add",
      [](py::array a, py::array b, const std::string& device, const std::string& out_alias) {
        const Device dev = Device::parse(device);
        Tensor ta = arg(a, dev), tb = arg(b, dev);
        Tensor out = out_alias == "a" ? ta : out_alias == "b" ? tb : Tensor::empty(ta.shape(), ta.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::add(ta, tb, out);
        }
        return to_numpy(out);
      },
      py::arg("a"), py::arg("b"), py::arg("device") = "cpu", py::arg("out_alias") = "");

  m.def(
      "op_kv_write",
      [](py::array k, py::array v, py::array k_pages, py::array v_pages, py::array positions, py::array seq_of_token,
         py::array page_table, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tk = arg(k, dev), tv = arg(v, dev), tkp = arg(k_pages, dev), tvp = arg(v_pages, dev);
        Tensor tp = arg(positions, dev), ts = arg(seq_of_token, dev), tt = arg(page_table, dev);
        {
          py::gil_scoped_release nogil;
          ops::kv_write(tk, tv, tkp, tvp, tp, ts, tt);
        }
        return py::make_tuple(to_numpy(tkp), to_numpy(tvp));
      },
      py::arg("k"), py::arg("v"), py::arg("k_pages"), py::arg("v_pages"), py::arg("positions"), py::arg("seq_of_token"),
      py::arg("page_table"), py::arg("device") = "cpu");

  m.def(
      "op_rope_qk_kv_write",
      [](py::array q, py::array k, py::array v, py::array positions, py::array cos_sin, py::array k_pages,
         py::array v_pages, py::array seq_of_token, py::array page_table, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tq = arg(q, dev), tk = arg(k, dev), tv = arg(v, dev), tp = arg(positions, dev), tc = arg(cos_sin, dev);
        Tensor tkp = arg(k_pages, dev), tvp = arg(v_pages, dev), ts = arg(seq_of_token, dev), tt = arg(page_table, dev);
        {
          py::gil_scoped_release nogil;
          ops::rope_qk_kv_write(tq, tk, tv, tp, tc, tkp, tvp, ts, tt);
        }
        return py::make_tuple(to_numpy(tq), to_numpy(tk), to_numpy(tkp), to_numpy(tvp));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"), py::arg("cos_sin"), py::arg("k_pages"),
      py::arg("v_pages"), py::arg("seq_of_token"), py::arg("page_table"), py::arg("device") = "cpu",
      "(q, k, k_pages, v_pages) after ops::rope_qk_kv_write (rope_qk + kv_write, one kernel on CUDA).");

  m.def(
      "op_attention_paged",
      [](py::array q, py::array k_pages, py::array v_pages, py::array positions, py::array seq_of_token,
         py::array page_table, float scale, const std::string& device, std::optional<int64_t> n_decode,
         int64_t window, float softcap) {
        // n_decode None: the rows planned from seq_of_token as a model step plans them (ops::attention_spans);
        // an int: one call with that hint (ops.h; -1: no hint).
        const Device dev = Device::parse(device);
        Tensor tq = arg(q, dev), tkp = arg(k_pages, dev), tvp = arg(v_pages, dev);
        Tensor tp = arg(positions, dev), ts = arg(seq_of_token, dev), tt = arg(page_table, dev);
        Tensor out = Tensor::empty(tq.shape(), tq.dtype(), dev);
        std::vector<ops::AttentionSpan> spans;
        const Tensor hs = from_numpy(seq_of_token, "");
        if (!n_decode && hs.dtype() == DType::I32 && hs.dim() == 1 && hs.size(0) == tq.size(0))
          spans = ops::attention_spans(hs.data_as<int32_t>(), hs.size(0));  // else the op's checks raise
        {
          py::gil_scoped_release nogil;
          if (n_decode)
            ops::attention_paged(tq, tkp, tvp, tp, ts, tt, scale, out, *n_decode, window, softcap);
          else
            ops::attention_paged_spans(tq, tkp, tvp, tp, ts, tt, scale, out, spans, window, softcap);
        }
        return to_numpy(out);
      },
      py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("positions"), py::arg("seq_of_token"),
      py::arg("page_table"), py::arg("scale"), py::arg("device") = "cpu", py::arg("n_decode") = py::none(),
      py::arg("window") = 0, py::arg("softcap") = 0.0f);

  m.def(
      "op_attention_spans",
      [](py::array seq_of_token) {
        const Tensor hs = from_numpy(seq_of_token, "");
        EXL2_CHECK(hs.dtype() == DType::I32 && hs.dim() == 1,
                   "op_attention_spans: seq_of_token must be int32 [n], got ", hs.describe());
        py::list spans;
        for (const ops::AttentionSpan& s : ops::attention_spans(hs.data_as<int32_t>(), hs.size(0)))
          spans.append(py::make_tuple(s.begin, s.end, s.n_decode));
        return spans;
      },
      "The attention calls a model step makes for this row layout (ops::attention_spans): [(begin, end, n_decode)].",
      py::arg("seq_of_token"));

  // Quantized KV cache (cache/kv_quant.h): kernels, and the rotation on rows of a float32 array [..., head_dim].
  m.def(
      "op_kv_write_q",
      [](py::array k, py::array v, py::array k_q, py::array k_s, py::array v_q, py::array v_s, int bits,
         py::array positions, py::array seq_of_token, py::array page_table, const std::string& device,
         std::optional<py::array> k_mean, std::optional<py::array> rope, std::optional<py::array> k_sink,
         std::optional<py::array> v_sink) {
        const Device dev = Device::parse(device);
        Tensor tk = arg(k, dev), tv = arg(v, dev), tkq = arg(k_q, dev), tks = arg(k_s, dev, "f16");
        Tensor tvq = arg(v_q, dev), tvs = arg(v_s, dev, "f16");
        Tensor tp = arg(positions, dev), ts = arg(seq_of_token, dev), tt = arg(page_table, dev);
        Tensor tmu = k_mean ? arg(*k_mean, dev) : Tensor();
        Tensor trope = rope ? arg(*rope, dev) : Tensor();
        Tensor tksink = k_sink ? arg(*k_sink, dev, "f16") : Tensor();
        Tensor tvsink = v_sink ? arg(*v_sink, dev, "f16") : Tensor();
        {
          py::gil_scoped_release nogil;
          ops::kv_write_q(tk, tv, tkq, tks, tvq, tvs, bits, tp, ts, tt, tmu, trope, tksink, tvsink);
        }
        if (tksink.defined())  // (k_q, k_s, v_q, v_s, k_sink, v_sink) when sink stores were passed
          return py::tuple(py::make_tuple(to_numpy(tkq), to_numpy(tks), to_numpy(tvq), to_numpy(tvs), to_numpy(tksink),
                                          to_numpy(tvsink)));
        return py::tuple(py::make_tuple(to_numpy(tkq), to_numpy(tks), to_numpy(tvq), to_numpy(tvs)));
      },
      py::arg("k"), py::arg("v"), py::arg("k_q"), py::arg("k_s"), py::arg("v_q"), py::arg("v_s"), py::arg("bits"),
      py::arg("positions"), py::arg("seq_of_token"), py::arg("page_table"), py::arg("device") = "cpu",
      py::arg("k_mean") = py::none(), py::arg("rope") = py::none(), py::arg("k_sink") = py::none(),
      py::arg("v_sink") = py::none());

  m.def(
      "op_attention_paged_q",
      [](py::array q, py::array k_q, py::array k_s, py::array v_q, py::array v_s, int bits, py::array positions,
         py::array seq_of_token, py::array page_table, float scale, const std::string& device,
         std::optional<py::array> k_mean, std::optional<py::array> rope, std::optional<py::array> k_sink,
         std::optional<py::array> v_sink, int64_t window, float softcap) {
        const Device dev = Device::parse(device);
        Tensor tq = arg(q, dev), tkq = arg(k_q, dev), tks = arg(k_s, dev, "f16");
        Tensor tvq = arg(v_q, dev), tvs = arg(v_s, dev, "f16");
        Tensor tp = arg(positions, dev), ts = arg(seq_of_token, dev), tt = arg(page_table, dev);
        Tensor tmu = k_mean ? arg(*k_mean, dev) : Tensor();
        Tensor trope = rope ? arg(*rope, dev) : Tensor();
        Tensor tksink = k_sink ? arg(*k_sink, dev, "f16") : Tensor();
        Tensor tvsink = v_sink ? arg(*v_sink, dev, "f16") : Tensor();
        Tensor out = Tensor::empty(tq.shape(), tq.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::attention_paged_q(tq, tkq, tks, tvq, tvs, bits, tp, ts, tt, scale, out, tmu, trope, tksink, tvsink, window,
                                 softcap);
        }
        return to_numpy(out);
      },
      py::arg("q"), py::arg("k_q"), py::arg("k_s"), py::arg("v_q"), py::arg("v_s"), py::arg("bits"),
      py::arg("positions"), py::arg("seq_of_token"), py::arg("page_table"), py::arg("scale"), py::arg("device") = "cpu",
      py::arg("k_mean") = py::none(), py::arg("rope") = py::none(), py::arg("k_sink") = py::none(),
      py::arg("v_sink") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0f);

  m.def(
      "kv_rotate",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, bool inverse) {
        EXL2_CHECK(x.ndim() >= 1 && x.shape(x.ndim() - 1) % kKvQuantBlock == 0,
                   "kv_rotate: x must be float32 [..., head_dim] with head_dim % 32 == 0");
        py::array_t<float> y(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        const int64_t d = x.shape(x.ndim() - 1), rows = x.size() / d;
        std::copy(x.data(), x.data() + x.size(), y.mutable_data());
        for (int64_t r = 0; r < rows; ++r) (inverse ? kv_unrotate : kv_rotate)(y.mutable_data() + r * d, d);
        return y;
      },
      py::arg("x"), py::arg("inverse") = false, "R x (or R^-1 x) on each row: the quantized cache's rotation.");

  m.def(
      "op_gather_rows",
      [](py::array x, py::array idx, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tx = arg(x, dev), ti = arg(idx, dev);
        Tensor out = Tensor::empty({ti.dim() ? ti.size(0) : 0, tx.dim() == 2 ? tx.size(1) : 0}, tx.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::gather_rows(tx, ti, out);
        }
        return to_numpy(out);
      },
      py::arg("x"), py::arg("idx"), py::arg("device") = "cpu");

  m.def(
      "op_argmax_logprob",
      [](py::array logits, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tl = arg(logits, dev);
        const int64_t rows = tl.dim() ? tl.size(0) : 0;
        Tensor index = Tensor::empty({rows}, DType::I32, dev), logprob = Tensor::empty({rows}, DType::F32, dev);
        {
          py::gil_scoped_release nogil;
          ops::argmax_logprob(tl, index, logprob);
        }
        return py::make_tuple(to_numpy(index), to_numpy(logprob));
      },
      py::arg("logits"), py::arg("device") = "cpu", "(index i32 [rows], logprob f32 [rows]): ops::argmax_logprob.");

  m.def(
      "op_logit_kl",
      [](py::array z, py::array d, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tz = arg(z, dev), td = arg(d, dev);
        Tensor out = Tensor::empty({tz.dim() ? tz.size(0) : 0}, DType::F32, dev);
        {
          py::gil_scoped_release nogil;
          ops::logit_kl(tz, td, out);
        }
        return to_numpy(out);
      },
      py::arg("z"), py::arg("d"), py::arg("device") = "cpu", "(kl f32 [rows]): ops::logit_kl.");

  m.def(
      "op_sample_logprob",
      [](py::array logits, const std::vector<float>& temperature, const std::vector<int32_t>& top_k,
         const std::vector<float>& top_p, const std::vector<float>& min_p, const std::vector<double>& u,
         const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tl = arg(logits, dev);
        const int64_t rows = tl.dim() ? tl.size(0) : 0;
        const size_t n = static_cast<size_t>(rows);
        EXL2_CHECK(temperature.size() == n && top_k.size() == n && top_p.size() == n && min_p.size() == n &&
                       u.size() == n,
                   "op_sample_logprob: temperature, top_k, top_p, min_p and u need one entry per row (", rows, ")");
        std::vector<SampleParams> p(n);
        for (size_t r = 0; r < n; ++r) p[r] = {u[r], temperature[r], top_k[r], top_p[r], min_p[r]};
        const int64_t pb = static_cast<int64_t>(sizeof(SampleParams));
        Tensor host = Tensor::from_blob(p.data(), {rows, pb}, DType::U8, Device::cpu());
        Tensor params = dev.is_cpu() ? host : Tensor::empty({rows, pb}, DType::U8, dev);
        if (!dev.is_cpu()) device::copy(params.data(), dev, host.data(), Device::cpu(), host.nbytes());
        Tensor index = Tensor::empty({rows}, DType::I32, dev), logprob = Tensor::empty({rows}, DType::F32, dev);
        {
          py::gil_scoped_release nogil;
          ops::sample_logprob(tl, params, index, logprob);
        }
        return py::make_tuple(to_numpy(index), to_numpy(logprob));
      },
      py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
      py::arg("device") = "cpu",
      "(index i32 [rows], logprob f32 [rows]): ops::sample_logprob with one (temperature, top_k, top_p, min_p, u) "
      "per row.");

  m.def(
      "op_convert",
      [](py::array src, const std::string& dtype, const std::string& device, const std::string& src_dtype) {
        const Device dev = Device::parse(device);
        Tensor ts = arg(src, dev, src_dtype);
        Tensor out = Tensor::empty(ts.shape(), act_dtype(dtype), dev);
        {
          py::gil_scoped_release nogil;
          ops::convert(ts, out);
        }
        return to_numpy(out);
      },
      py::arg("src"), py::arg("dtype"), py::arg("device") = "cpu", py::arg("src_dtype") = "");
  bind_moe(m);  // bind_moe.cpp
}

}  // namespace exl2
