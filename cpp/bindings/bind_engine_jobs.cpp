// Bindings for the serving engine (exl2cpp._C.Engine): options, submit/cancel/step/stats. step() releases the GIL;
// events cross as tuples (job_id, token, logprob, top, finished, finish_reason, error) to keep per-token cost low.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "core/device_api.h"
#include "engine/engine.h"
#include "exl2/errors.h"

namespace py = pybind11;

namespace exl2 {

void bind_engine_jobs(pybind11::module_& m) {
  m.def(
      "cuda_mem_info",
      [](int index) {
        size_t free_bytes = 0, total_bytes = 0;
        device::cuda_mem_info(index, &free_bytes, &total_bytes);
        return py::make_tuple(free_bytes, total_bytes);
      },
      py::arg("index") = 0, "(free, total) bytes of CUDA device `index` (sizes the engine's cache).");
  m.def(
      "engine_cache_tokens",
      [](const Model& model, int64_t n_tokens, int page_size, int64_t max_batch_tokens) {
        return job_cache_tokens(model.window_layout(), n_tokens, page_size, max_batch_tokens);
      },
      py::arg("model"), py::arg("n_tokens"), py::arg("page_size") = 256, py::arg("max_batch_tokens") = 2048,
      "Cache tokens (of every layer) an engine job of n_tokens positions holds at most (engine.h job_cache_tokens): "
      "less than n_tokens for a model with sliding-window layers.");
  py::class_<Engine>(m, "Engine", "The batching engine over one paged KV cache (see cpp/engine/engine.h).")
      .def(py::init([](Model& model, int64_t cache_tokens, int page_size, int64_t max_batch_tokens, int64_t max_jobs,
                       int64_t aging_steps, bool prefix_cache, const std::string& cache_type, Model* draft_model,
                       int32_t draft_tokens, bool ngram_draft, std::vector<int32_t> ngram_sizes) {
             EngineOptions o;
             o.cache_tokens = cache_tokens;
             o.page_size = page_size;
             o.max_batch_tokens = max_batch_tokens;
             o.max_jobs = max_jobs;
             o.aging_steps = aging_steps;
             o.prefix_cache = prefix_cache;
             o.cache_type = cache_type;
             o.draft_tokens = draft_tokens;
             o.ngram_draft = ngram_draft;
             o.ngram_sizes = std::move(ngram_sizes);
             return std::make_unique<Engine>(model, o, draft_model);
           }),
           py::arg("model"), py::kw_only(), py::arg("cache_tokens") = 16384, py::arg("page_size") = 256,
           py::arg("max_batch_tokens") = 2048, py::arg("max_jobs") = 0, py::arg("aging_steps") = 16,
           py::arg("prefix_cache") = true, py::arg("cache_type") = "auto", py::arg("draft_model") = nullptr,
           py::arg("draft_tokens") = 4, py::arg("ngram_draft") = false,
           py::arg("ngram_sizes") = std::vector<int32_t>{4, 3, 2}, py::keep_alive<1, 2>(), py::keep_alive<1, 10>())
      .def_property_readonly("cache_type", [](Engine& e) { return std::string(cache_type_name(e.cache().type())); })
      .def(
          "submit",
          [](Engine& e, std::vector<int32_t> prompt, int64_t max_new_tokens, std::vector<int32_t> stop_tokens,
             const SamplerSettings& sampler, int32_t priority, std::vector<uint32_t> token_mask, int32_t max_rewinds,
             bool speculate, bool constrained) {
            JobSpec s;
            s.prompt = std::move(prompt);
            s.max_new_tokens = max_new_tokens;
            s.stop_tokens = std::move(stop_tokens);
            s.sampler = sampler;
            s.priority = priority;
            s.token_mask = std::move(token_mask);
            s.max_rewinds = max_rewinds;
            s.speculate = speculate;
            s.constrained = constrained;
            return e.submit(std::move(s));
          },
          py::arg("prompt"), py::kw_only(), py::arg("max_new_tokens") = 256,
          py::arg("stop_tokens") = std::vector<int32_t>{}, py::arg("sampler") = SamplerSettings{},
          py::arg("priority") = 0, py::arg("token_mask") = std::vector<uint32_t>{}, py::arg("max_rewinds") = 16,
          py::arg("speculate") = true, py::arg("constrained") = false)
      .def("set_token_mask", &Engine::set_token_mask, py::arg("job_id"), py::arg("mask"),
           "Replace a job's allowed-token bitmask (uint32 words; empty lifts it); see engine.h.")
      .def("set_draft_masks", &Engine::set_draft_masks, py::arg("fn"),
           "fn(job_id, drafts) -> masks after each accepted draft: constrained jobs speculate (engine.h DraftMaskFn); "
           "None: they do not. Before the first submit.")
      .def("rewind", &Engine::rewind, py::arg("job_id"), py::arg("keep"), py::arg("ban") = -1,
           "Take back a job's generated tokens from index `keep` on and ban `ban` there (see engine.h).")
      .def("cancel", &Engine::cancel, py::arg("job_id"), py::arg("reason") = "cancelled")
      .def(
          "step",
          [](Engine& e, bool spec_counts) {
            std::vector<EngineEvent> events;
            {
              py::gil_scoped_release release;
              events = e.step();
            }
            py::list out;
            for (EngineEvent& ev : events)
              if (spec_counts)
                out.append(py::make_tuple(ev.job_id, ev.token, ev.logprob, py::cast(ev.top), ev.finished,
                                          ev.finish_reason, ev.error, ev.spec_proposed, ev.spec_accepted,
                                          ev.tokens_reused));
              else
                out.append(py::make_tuple(ev.job_id, ev.token, ev.logprob, py::cast(ev.top), ev.finished,
                                          ev.finish_reason, ev.error));
            return out;
          },
          py::arg("spec_counts") = false,
          "One engine step: event tuples (job_id, token, logprob, top, finished, finish_reason, error), with the "
          "job's (spec_proposed, spec_accepted, tokens_reused) appended when spec_counts.")
      .def_property_readonly("idle", &Engine::idle)
      .def("stats",
           [](const Engine& e) {
             const EngineStats s = e.stats();
             py::dict d;
             d["pages_total"] = s.pages_total;
             d["pages_used"] = s.pages_used;
             d["pages_free"] = s.pages_free;
             d["pages_shared"] = s.pages_shared;
             d["pages_cached"] = s.pages_cached;
             d["pages_evictable"] = s.pages_evictable;
             d["layer_groups"] = s.layer_groups;
             d["pages_window_freed"] = s.pages_window_freed;
             d["pages_reserved"] = s.pages_reserved;
             d["jobs_queued"] = s.jobs_queued;
             d["jobs_active"] = s.jobs_active;
             d["jobs_submitted"] = s.jobs_submitted;
             d["jobs_finished"] = s.jobs_finished;
             d["tokens_in"] = s.tokens_in;
             d["tokens_prefilled"] = s.tokens_prefilled;
             d["tokens_reused"] = s.tokens_reused;
             d["tokens_out"] = s.tokens_out;
             d["tokens_device_argmax"] = s.tokens_device_argmax;
             d["tokens_device_sampled"] = s.tokens_device_sampled;
             d["steps"] = s.steps;
             d["rewinds"] = s.rewinds;
             d["preemptions"] = s.preemptions;
             d["tokens_recomputed"] = s.tokens_recomputed;
             d["spec_proposed"] = s.spec_proposed;
             d["spec_accepted"] = s.spec_accepted;
             d["draft_steps"] = s.draft_steps;
             d["draft_pages_total"] = s.draft_pages_total;
             d["draft_pages_free"] = s.draft_pages_free;
             d["draft_pages_cached"] = s.draft_pages_cached;
             d["draft_pages_window_freed"] = s.draft_pages_window_freed;
             return d;
           })
      .def("clear_prefix_cache", &Engine::clear_prefix_cache)
      .def("job_tokens", &Engine::job_tokens, py::arg("job_id"))
      .def("job_pages", &Engine::job_pages, py::arg("job_id"), py::arg("group") = 0)
      .def("pages_needed", &Engine::pages_needed, py::arg("n_tokens"))
      .def("cache_tokens_needed", &Engine::cache_tokens_needed, py::arg("n_tokens"))
      .def_property_readonly("page_size", [](Engine& e) { return e.cache().page_size(); })
      .def_property_readonly("n_pages", [](Engine& e) { return e.cache().n_pages(); })
      .def_property_readonly("bytes_per_token", [](Engine& e) { return e.cache().bytes_per_token(); })
      .def("page_refcount", [](Engine& e, int32_t page) { return e.cache().pool().refcount(page); });
}

}  // namespace exl2
