// The engine's per-job state and per-step plan entries, shared by engine.cpp (scheduler) and engine_spec.cpp
// (speculative decoding). Private to cpp/engine/.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace exl2 {

struct Engine::Job {
  int64_t id = 0;
  JobSpec spec;
  Sampler sampler;
  std::vector<int32_t> tokens;     // prompt + generated
  std::vector<int32_t> generated;  // generated only (frequency/presence penalties)
  int64_t prompt_len = 0;
  int64_t max_total = 0;         // tokens (prompt + generated) at which the job ends with "length"
  int64_t total_pages = 0;       // worst-case pages: KV of positions 0 .. max(max_total - 1, prompt_len) - 1
  int64_t n_cached = 0;          // positions whose K/V are in the cache
  // Per layer group of the cache (kv_cache.h CacheLayout), its page of each logical page i (positions
  // [i * page_size, (i + 1) * page_size)), one reference each; -1 below first_live[g]: given back, behind the
  // group's window (Engine::trim_window). Every group has the same number of logical pages.
  std::vector<std::vector<int32_t>> pages;
  std::vector<int64_t> first_live;  // per group: its pages [0, first_live) are given back
  int64_t n_logical() const { return pages.empty() ? 0 : static_cast<int64_t>(pages[0].size()); }
  std::vector<uint64_t> hashes;  // chained hashes of the full pages whose tokens are known
  int64_t n_registered = 0;      // pages already offered to the prefix table
  std::vector<uint64_t> pending_owned;
  int64_t reserved = 0;  // pages still promised to this job (admission: its prefill and first decode row)
  int64_t submit_step = 0;
  int64_t admit_seq = 0;        // order of its latest admission (the most recent is preempted first)
  int64_t preempted_step = -1;  // the planning round (rounds_) that last preempted it: not readmitted in it
  int64_t recompute_until = 0;  // positions computed before its last preemption (tokens_recomputed)
  int64_t rewinds = 0;          // successful Engine::rewind calls (JobSpec::max_rewinds)
  bool requeued = false;        // preempted and waiting: ahead of the queued jobs of its priority
  bool active = false, in_flight = false, cancel_requested = false;
  std::string cancel_reason;
  std::vector<uint32_t> mask, next_mask;  // token mask (JobSpec::token_mask); next_mask: set while in_flight
  bool has_next_mask = false;
  std::map<int64_t, std::vector<int32_t>> bans;  // generated index -> ids banned there (Engine::rewind)
  // Speculative decoding (engine.h "Speculative decoding").
  int64_t spec_k = 0;         // adaptive draft length of its next decode row; 0: off until spec_probe_at
  int64_t spec_wait = 0;      // the off period (generated tokens) of its last failed probe; 0 after an acceptance
  int64_t spec_probe_at = 0;  // generated count from which an off job probes with one draft token
  int64_t spec_proposed = 0, spec_accepted = 0;
  int64_t tokens_reused = 0;  // prompt tokens taken from shared pages (EngineEvent::tokens_reused)
  // Draft model KV: its pages in the draft cache (one reference each; -1 below d_first_live: given back, behind the
  // draft model's window, Engine::draft_trim), positions held, pages offered to its table.
  std::vector<int32_t> dpages;
  int64_t d_cached = 0, d_registered = 0, d_first_live = 0;

  explicit Job(const SamplerSettings& s) : sampler(s) {}
};

struct Engine::Planned {
  Planned(Job* j, int64_t start_, int64_t len_) : job(j), start(start_), len(len_) {}
  Job* job;
  int64_t start, len;
  int32_t logit_row = -1;  // index into the logits, or -1
  bool on_device = false;  // its token is picked on the logits' device (device_argmax_enabled, device_sample_enabled)
  bool sampled = false;    // ... and drawn there under its sampler's filters (device_sample_enabled)
  // Speculative decode row: len = 1 + drafts.size(), one logit row each from logit_row on.
  std::vector<int32_t> drafts;         // n-gram drafts at planning; draft-model ones filled by run_draft
  int64_t n_draft = 0;                 // draft tokens planned (drafts.size() once filled)
  std::vector<std::vector<double>> q;  // per draft token: the draft model's distribution (sampled jobs), else empty
  // Constrained jobs (a token mask): the masks of positions 1 .. n (DraftMaskFn); positions 0 .. n are verified.
  std::vector<std::vector<uint32_t>> masks;
  int32_t row0 = 0;                    // its first row in the batch
  std::vector<SampleResult> out;       // the tokens this row produced, in order (speculative rows)
  int64_t accepted = 0;                // of its drafts
};

// Prompt lookup: for each n of `sizes` in order, the most recent earlier occurrence of the last n tokens of `tokens`
// whose continuation is known; `out` gets up to k tokens of that continuation (empty when no n matches).
void ngram_drafts(const std::vector<int32_t>& tokens, const std::vector<int32_t>& sizes, int64_t k,
                  std::vector<int32_t>& out);

// Sets the logits of the ids `mask` does not allow (JobSpec::token_mask layout; ids past its end are not allowed) to
// -inf in row[vocab]; returns how many ids it allows.
int64_t apply_token_mask(const std::vector<uint32_t>& mask, float* row, int64_t vocab);

constexpr uint64_t kRootHash = 0x65786C32ull;  // "exl2": the chained page hash's parent of page 0

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace exl2
