// Speculative decoding in the engine (see engine/engine.h "Speculative decoding"): which jobs draft and how many
// tokens, n-gram drafts, and the draft model's rows, pages and prefix table.
#include <algorithm>
#include <cstring>
#include <limits>

#include "backend/cpu/thread_pool.h"
#include "engine/engine.h"
#include "engine/engine_job.h"
#include "exl2/errors.h"

namespace exl2 {

namespace {

constexpr int64_t kFirstWait = 8;   // generated tokens an off job waits before its first probe
constexpr int64_t kMaxWait = 256;   // ... at most, after repeated failed probes

}  // namespace

void ngram_drafts(const std::vector<int32_t>& tokens, const std::vector<int32_t>& sizes, int64_t k,
                  std::vector<int32_t>& out) {
  out.clear();
  const int64_t n_tok = static_cast<int64_t>(tokens.size());
  for (int32_t n : sizes) {
    if (n >= n_tok) continue;
    const int32_t* tail = tokens.data() + n_tok - n;
    // Latest start i < n_tok - n with tokens[i, i + n) == tail (its continuation begins at i + n < n_tok).
    for (int64_t i = n_tok - n - 1; i >= 0; --i) {
      if (tokens[i] != tail[0] || std::memcmp(tokens.data() + i, tail, sizeof(int32_t) * n) != 0) continue;
      const int64_t from = i + n, to = std::min(n_tok, from + k);
      out.assign(tokens.begin() + from, tokens.begin() + to);
      return;
    }
  }
}

int64_t apply_token_mask(const std::vector<uint32_t>& mask, float* row, int64_t vocab) {
  const int64_t words = static_cast<int64_t>(mask.size());
  int64_t n = 0;
  for (int64_t id = 0; id < vocab; ++id) {
    if ((id >> 5) < words && ((mask[id >> 5] >> (id & 31)) & 1u))
      ++n;
    else
      row[id] = -std::numeric_limits<float>::infinity();
  }
  return n;
}

bool Engine::spec_allowed(const Job& j) const {
  if (!drafting() || !j.spec.speculate || ((!j.mask.empty() || j.spec.constrained) && !draft_masks_)) return false;
  if (j.bans.count(static_cast<int64_t>(j.generated.size()))) return false;
  const SamplerSettings& s = j.sampler.settings();
  return !(draft_ && s.temperature > 0.0f && s.mirostat());
}

int64_t Engine::spec_length(const Job& j) const {
  if (!spec_allowed(j)) return 0;
  int64_t k = j.spec_k;
  if (k == 0 && static_cast<int64_t>(j.generated.size()) >= j.spec_probe_at) k = 1;
  // Never past max_total: the step's k + 1 tokens must all be allowed.
  return std::max<int64_t>(0, std::min(k, j.max_total - static_cast<int64_t>(j.tokens.size()) - 1));
}

void Engine::spec_update(Job& j, int64_t proposed, int64_t accepted) {
  j.spec_proposed += proposed;
  j.spec_accepted += accepted;
  if (accepted == proposed)
    j.spec_k = std::min<int64_t>(options_.draft_tokens, proposed + 1);
  else if (accepted > 0)
    j.spec_k = accepted + 1;
  else
    j.spec_k = proposed / 2;
  if (accepted > 0) {
    j.spec_wait = 0;
  } else if (j.spec_k == 0) {
    j.spec_wait = j.spec_wait == 0 ? kFirstWait : std::min(kMaxWait, 2 * j.spec_wait);
    j.spec_probe_at = static_cast<int64_t>(j.generated.size()) + 1 + j.spec_wait;
  }
}

bool Engine::draft_prepare(Job& j, int64_t k) {
  const int64_t ps = options_.page_size;
  const int64_t n_tok = static_cast<int64_t>(j.tokens.size());
  PagePool& pool = draft_cache_->pool();
  if (options_.prefix_cache) {  // cached full pages of its known tokens (never the one of its last token)
    extend_hashes(j);
    while (j.d_cached % ps == 0 && static_cast<int64_t>(j.dpages.size()) == j.d_cached / ps &&
           j.d_cached + ps <= n_tok - 1 && j.d_cached / ps < static_cast<int64_t>(j.hashes.size())) {
      const int64_t i = j.d_cached / ps;
      auto it = dtable_.find(j.hashes[i]);
      if (it == dtable_.end()) break;
      const CacheEntry& e = it->second;
      if (e.parent != (i == 0 ? kRootHash : j.hashes[i - 1]) ||
          std::memcmp(e.tokens.data(), j.tokens.data() + i * ps, sizeof(int32_t) * ps) != 0)
        break;
      pool.retain(e.page);
      dlru_.splice(dlru_.end(), dlru_, e.lru);
      j.dpages.push_back(e.page);
      j.d_cached += ps;
      j.d_registered = i + 1;
    }
  }
  // Rows: its tokens from d_cached on, then drafts d_0 .. d_{k-2} at positions n_tok .. n_tok + k - 2.
  const int64_t want = ceil_div(n_tok + k - 1, ps) - static_cast<int64_t>(j.dpages.size());
  if (want <= 0) return true;
  evict(dtable_, dlru_, pool, want);
  if (pool.n_free() < want) return false;
  std::vector<int32_t> fresh = pool.alloc(want);
  j.dpages.insert(j.dpages.end(), fresh.begin(), fresh.end());
  return true;
}

void Engine::draft_trim(Job& j) {
  const int64_t ps = options_.page_size;
  PagePool& pool = draft_cache_->pool();
  const size_t keep = static_cast<size_t>(ceil_div(j.d_cached, ps));
  for (size_t i = keep; i < j.dpages.size(); ++i) pool.release(j.dpages[i]);
  if (j.dpages.size() > keep) j.dpages.resize(keep);
  extend_hashes(j);
  while ((j.d_registered + 1) * ps <= j.d_cached && j.d_registered < static_cast<int64_t>(j.hashes.size())) {
    const int64_t i = j.d_registered++;
    const uint64_t h = j.hashes[i];
    if (!options_.prefix_cache || dtable_.count(h) || j.dpages[i] < 0) continue;
    CacheEntry e;
    e.page = j.dpages[i];
    e.parent = i == 0 ? kRootHash : j.hashes[i - 1];
    e.tokens.assign(j.tokens.begin() + i * ps, j.tokens.begin() + (i + 1) * ps);
    e.lru = dlru_.insert(dlru_.end(), h);
    pool.retain(e.page);
    dtable_.emplace(h, std::move(e));
  }
  // Behind the draft window (registered first, so the prefix table keeps what it holds).
  const int64_t to = std::min<int64_t>(draft_live_from(j.d_cached), static_cast<int64_t>(j.dpages.size()));
  for (; j.d_first_live < to; ++j.d_first_live) {
    int32_t& p = j.dpages[static_cast<size_t>(j.d_first_live)];
    if (p >= 0) {
      pool.release(p);
      counters_.draft_pages_window_freed++;
    }
    p = -1;
  }
}

void Engine::draft_release(Job& j) {
  if (!draft_cache_) return;
  release_held(dtable_, dlru_, draft_cache_->pool(), j.hashes, j.dpages, j.d_registered);
  j.d_cached = 0;
  j.d_registered = 0;
  j.d_first_live = 0;
}

int64_t Engine::run_draft(std::vector<Planned>& plan, bool device_argmax) {
  std::vector<Planned*> jobs;
  int64_t rounds = 0;
  for (Planned& p : plan)
    if (p.n_draft > 0) {
      jobs.push_back(&p);
      rounds = std::max(rounds, p.n_draft);
    }
  if (jobs.empty()) return 0;
  int64_t forwards = 0;
  // A piece of one job's rows: positions [start, start + len), its last row proposing when `last`.
  struct Piece {
    Planned* p;
    int64_t start, len;
    bool last;
  };
  const int64_t cap = options_.max_batch_tokens;
  for (int64_t r = 0; r < rounds; ++r) {
    // Round 0: each job's unseen tokens (catch-up, ending at its last token); round r: its draft d_{r-1}.
    std::vector<Piece> pieces;
    for (Planned* p : jobs) {
      if (p->n_draft <= r) continue;
      Job& j = *p->job;
      const int64_t n_tok = static_cast<int64_t>(j.tokens.size());
      const int64_t start = r == 0 ? j.d_cached : n_tok - 1 + r;
      const int64_t end = n_tok + r;  // exclusive
      for (int64_t s = start; s < end; s += cap) pieces.push_back({p, s, std::min(cap, end - s), s + cap >= end});
    }
    // Pack the pieces into forwards of at most max_batch_tokens rows.
    size_t i = 0;
    while (i < pieces.size()) {
      size_t e = i;
      int64_t rows = 0;
      while (e < pieces.size() && rows + pieces[e].len <= cap) rows += pieces[e++].len;
      Batch batch;
      DeviceArgmax argmax;
      int32_t pps = 1;
      for (size_t t = i; t < e; ++t) pps = std::max<int32_t>(pps, static_cast<int32_t>(pieces[t].p->job->dpages.size()));
      batch.pages_per_seq = pps;
      batch.page_table.assign((e - i) * pps, 0);
      std::vector<size_t> proposing;  // pieces whose last row proposes, in logit-row order
      for (size_t t = i; t < e; ++t) {
        const Piece& pc = pieces[t];
        Job& j = *pc.p->job;
        const int64_t n_tok = static_cast<int64_t>(j.tokens.size());
        auto out = batch.page_table.begin() + (t - i) * pps;  // pages behind the window: the scratch page
        for (int32_t pg : j.dpages) *out++ = pg >= 0 ? pg : draft_cache_->scratch_page();
        for (int64_t pos = pc.start; pos < pc.start + pc.len; ++pos) {
          batch.tokens.push_back(pos < n_tok ? j.tokens[pos] : pc.p->drafts[pos - n_tok]);
          batch.positions.push_back(static_cast<int32_t>(pos));
          batch.seq_of_token.push_back(static_cast<int32_t>(t - i));
        }
        if (pc.last) {
          proposing.push_back(t);
          batch.logit_rows.push_back(static_cast<int32_t>(batch.tokens.size() - 1));
          argmax.rows.push_back(device_argmax && j.sampler.greedy_plain() && j.mask.empty() && !j.spec.constrained ? 1 : 0);
        }
      }
      if (batch.logit_rows.empty()) {  // catch-up chunks only
        batch.logit_rows.push_back(0);
        argmax.rows.push_back(device_argmax ? 1 : 0);
      }
      const bool any_on_device = std::find(argmax.rows.begin(), argmax.rows.end(), 1) != argmax.rows.end();
      Tensor logits = draft_->forward(batch, *draft_cache_, any_on_device ? &argmax : nullptr);
      ++forwards;
      const float* base = logits.data_as<float>();
      // Constrained jobs propose under the mask of their next position (the job's, then the DraftMaskFn's after
      // the drafts so far), so that their drafts follow the grammar. Without one (the function refused a draft or
      // failed: the verify step meets it again) the draft proposes unmasked; verification keeps the output right.
      std::vector<std::vector<uint32_t>> masks(proposing.size());
      for (size_t n = 0; n < proposing.size(); ++n) {
        const Planned& p = *pieces[proposing[n]].p;
        if (p.job->mask.empty() && !p.job->spec.constrained) continue;
        if (p.drafts.empty()) {
          masks[n] = p.job->mask;
          continue;
        }
        try {
          std::vector<std::vector<uint32_t>> after = draft_masks_(p.job->id, p.drafts);
          if (after.size() == p.drafts.size()) masks[n] = std::move(after.back());
        } catch (const std::exception&) {
        }
      }
      // Proposals on the CPU pool's threads, one job each (its own sampler and context); errors end the step.
      std::vector<std::string> errors(proposing.size());
      cpu::parallel_for(static_cast<int64_t>(proposing.size()), 1, [&](int64_t b, int64_t f) {
        for (int64_t n = b; n < f; ++n) {
          Planned& p = *pieces[proposing[static_cast<size_t>(n)]].p;
          Job& j = *p.job;
          const size_t n_tok = j.tokens.size(), n_gen = j.generated.size();
          try {
            int32_t token;
            std::vector<double> q;
            if (argmax.rows[n]) {
              token = argmax.index[n];
              EXL2_CHECK(token >= 0, "engine: the draft model's logits hold NaN/inf or are all -inf");
            } else {
              // The context of draft d_r: the job's tokens and d_0 .. d_{r-1} (taken back below).
              j.tokens.insert(j.tokens.end(), p.drafts.begin(), p.drafts.end());
              j.generated.insert(j.generated.end(), p.drafts.begin(), p.drafts.end());
              const float* row = base + n * vocab_;
              thread_local std::vector<float> limited;
              if (!masks[n].empty()) {  // empty: no constraint at that position (or none known): propose unmasked
                limited.assign(row, row + vocab_);
                if (apply_token_mask(masks[n], limited.data(), vocab_) > 0) row = limited.data();
              }
              token = j.sampler.propose(row, vocab_, j.tokens, j.generated,
                                        static_cast<int64_t>(j.generated.size()), &q);
            }
            p.drafts.push_back(token);
            if (j.sampler.settings().temperature > 0.0f) {
              p.q.resize(p.drafts.size());
              p.q.back() = std::move(q);
            }
          } catch (const std::exception& ex) {
            errors[static_cast<size_t>(n)] = ex.what();
          }
          j.tokens.resize(n_tok);
          j.generated.resize(n_gen);
        }
      });
      for (const std::string& err : errors) EXL2_CHECK(err.empty(), "engine: draft model: ", err);
      i = e;
    }
  }
  for (Planned* p : jobs) p->job->d_cached = static_cast<int64_t>(p->job->tokens.size()) + p->n_draft - 1;
  return forwards;
}

void Engine::set_draft_masks(DraftMaskFn fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  EXL2_CHECK(counters_.jobs_submitted == 0, "engine: set_draft_masks after jobs were submitted; set it right after "
             "constructing the engine");
  draft_masks_ = std::move(fn);
}

void Engine::draft_masks(Planned& p) {
  const Job& j = *p.job;
  p.masks = draft_masks_(j.id, p.drafts);
  EXL2_CHECK(p.masks.size() <= p.drafts.size(), "engine: the draft mask function returned ", p.masks.size(),
             " masks for ", p.drafts.size(), " drafts of job ", j.id, "; at most one per draft");
}

}  // namespace exl2
