// The serving engine's scheduler, page accounting and prefix cache (see engine/engine.h for the contract).
#include "engine/engine.h"
#include "engine/engine_job.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <new>

#include "backend/cpu/thread_pool.h"
#include "exl2/options.h"
#include "exl2/errors.h"

namespace exl2 {

namespace {

// The device argmax: option device_argmax (default on), read at every step. On, a row
// whose job samples greedily and needs nothing else of the logits (Sampler::greedy_plain, no token mask, no rewind
// ban at this position) is reduced on the logits' device (ops::argmax_logprob via Model::forward's DeviceArgmax)
// and only its token and logprob come back, not vocab floats; a step of such rows downloads no logits at all.
// Same tokens and logprobs as the host sampler (bit-identical on the CPU backend; on CUDA the same token, the
// logprob from an f32 exp-sum).
bool device_argmax_enabled() { return runtime_options().device_argmax; }

// Device sampling: option device_sample (default off), read at every step. On, a row whose
// job samples with temperature > 0 and at most top_k / top_p / min_p (Sampler::sampled_plain, no token mask, no
// rewind ban at this position) is drawn on the logits' device by ops::sample_logprob with u = Sampler::uniform(seed,
// step) from the host (Sampler::device_params), and only its token and logprob come back. Bit-identical tokens and
// logprobs to the host sampler on the CPU backend; on CUDA the same token but where a draw lands within rounding of
// a boundary (ops.h sample_logprob). Default off until the CUDA kernel is validated and measured on a GPU
// (tests/test_engine_device_sample.py -m cuda): flip the option's default then.
bool device_sample_enabled() { return runtime_options().device_sample; }

// Positions a windowed layer group keeps behind its window (Engine::live_from): a rewind (banned strings) back by
// up to this many tokens finds every page it reads; one further back recomputes the job (engine.h Sliding windows).
constexpr int64_t kWindowMargin = 64;

uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}


}  // namespace

void EngineOptions::validate() const {
  EXL2_CHECK(page_size > 0 && page_size <= 65536, "engine: page_size must be in [1, 65536], got ", page_size);
  EXL2_CHECK(cache_tokens > 0, "engine: cache_tokens must be positive, got ", cache_tokens);
  // Rows of a step are indexed with int32 (model.h Batch).
  EXL2_CHECK(max_batch_tokens > 0 && max_batch_tokens <= 2147483647,
             "engine: max_batch_tokens must be in [1, 2147483647], got ", max_batch_tokens);
  EXL2_CHECK(max_jobs >= 0 && max_jobs <= max_batch_tokens,
             "engine: max_jobs must be in [0 (auto), max_batch_tokens=", max_batch_tokens,
             "] (each running job decodes one row per step), got ", max_jobs);
  EXL2_CHECK(aging_steps > 0, "engine: aging_steps must be positive, got ", aging_steps);
  EXL2_CHECK(draft_tokens >= 1 && draft_tokens <= 32, "engine: draft_tokens must be in [1, 32], got ", draft_tokens);
  EXL2_CHECK(!ngram_sizes.empty(), "engine: ngram_sizes must list at least one n-gram length (e.g. [4, 3, 2])");
  for (int32_t n : ngram_sizes)
    EXL2_CHECK(n >= 1 && n <= 64, "engine: ngram_sizes entries must be in [1, 64], got ", n);
}

Engine::Engine(Model& model, const EngineOptions& options, Model* draft_model)
    : model_(model), options_(options), draft_(draft_model) {
  options_.validate();
  vocab_ = model.config().vocab_size;
  max_seq_len_ = model.max_seq_len();
  EXL2_CHECK(!(options_.ngram_draft && draft_), "engine: give ngram_draft or a draft model, not both");
  if (draft_) {
    EXL2_CHECK(draft_ != &model, "engine: the draft model must be a Model of its own (load the folder a second "
               "time to let a model draft for itself)");
    EXL2_CHECK(draft_->config().vocab_size == vocab_, "engine: the draft model's vocabulary has ",
               draft_->config().vocab_size, " ids but the model's has ", vocab_,
               "; a draft model must share the model's tokenizer");
    EXL2_CHECK(draft_->max_seq_len() >= max_seq_len_, "engine: the draft model's max_seq_len ", draft_->max_seq_len(),
               " is below the model's ", max_seq_len_, "; load the draft with max_seq_len >= ", max_seq_len_);
  }
  // Every running job's decode row (1 + draft tokens) fits one step: decode rows are planned first.
  const int64_t rows = drafting() ? 1 + options_.draft_tokens : 1;
  if (options_.max_jobs == 0) options_.max_jobs = std::min<int64_t>(128, options_.max_batch_tokens / rows);
  EXL2_CHECK(options_.max_jobs >= 1 && options_.max_jobs * rows <= options_.max_batch_tokens,
             "engine: max_jobs * (1 + draft_tokens) = ", options_.max_jobs * rows, " exceeds max_batch_tokens = ",
             options_.max_batch_tokens, " (each running job verifies up to draft_tokens drafts a step); lower "
             "max_jobs or draft_tokens, or raise max_batch_tokens");
  try {  // make_cache refuses what cannot fit; this names cache_tokens if a smaller allocation still fails
    cache_ = model.make_cache(options_.cache_tokens, options_.page_size,
                              parse_cache_type(options_.cache_type, model.device()), true);
  } catch (const std::bad_alloc&) {
    EXL2_FAIL(OutOfMemory, "engine: out of host memory allocating the KV cache of cache_tokens=",
              options_.cache_tokens, "; ask for fewer cache tokens");
  }
  if (draft_) {
    try {
      draft_cache_ = draft_->make_cache(options_.cache_tokens, options_.page_size,
                                        parse_cache_type(options_.cache_type, draft_->device()));
      draft_window_ = draft_->kv_window();
    } catch (const std::bad_alloc&) {
      EXL2_FAIL(OutOfMemory, "engine: out of host memory allocating the draft model's KV cache of cache_tokens=",
                options_.cache_tokens, "; ask for fewer cache tokens");
    }
  }
}

Engine::~Engine() = default;

uint64_t Engine::page_hash(uint64_t parent, const int32_t* tokens) const {
  uint64_t h = mix64(parent ^ 0x5851F42D4C957F2Dull);
  for (int i = 0; i < options_.page_size; ++i) h = mix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

const Engine::CacheEntry* Engine::lookup(uint64_t hash, uint64_t parent, const int32_t* tokens) const {
  auto it = table_.find(hash);
  if (it == table_.end()) return nullptr;
  const CacheEntry& e = it->second;
  if (e.parent != parent) return nullptr;
  if (std::memcmp(e.tokens.data(), tokens, sizeof(int32_t) * options_.page_size) != 0) return nullptr;
  return &e;
}

int64_t Engine::effective_priority(const Job& job) const {
  return static_cast<int64_t>(job.spec.priority) + (counters_.steps - job.submit_step) / options_.aging_steps;
}

int64_t Engine::count_evictable() const {
  int64_t n = 0;
  const PagePool& pool = cache_->pool();
  for (const auto& kv : table_) {
    if (kv.second.page >= 0 && pool.refcount(kv.second.page) == 1) ++n;
    for (int32_t p : kv.second.more)
      if (p >= 0 && pool.refcount(p) == 1) ++n;
  }
  return n;
}

int64_t Engine::evict(std::unordered_map<uint64_t, CacheEntry>& table, std::list<uint64_t>& lru, PagePool& pool,
                      int64_t want_free) {
  int64_t dropped = 0;
  for (auto it = lru.begin(); pool.n_free() < want_free && it != lru.end();) {
    CacheEntry& e = table.find(*it)->second;
    // Pages only the table holds are evicted; an entry goes when it holds none (layer groups: page by page).
    bool empty = true;
    auto drop = [&](int32_t& p) {
      if (p >= 0 && pool.n_free() < want_free && pool.refcount(p) == 1) {
        pool.release(p);
        p = -1;
        ++dropped;
      }
      empty = empty && p < 0;
    };
    for (int32_t& p : e.more) drop(p);
    drop(e.page);
    if (empty) {
      table.erase(*it);
      it = lru.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

std::vector<int32_t> Engine::alloc_pages(int64_t n) {
  evict(table_, lru_, cache_->pool(), n);
  return cache_->pool().alloc(n);  // throws OutOfMemory when even eviction could not make room (accounting bug)
}

int64_t Engine::submit(JobSpec spec) {
  EXL2_CHECK(!spec.prompt.empty(), "engine.submit: the prompt must hold at least one token");
  for (size_t i = 0; i < spec.prompt.size(); ++i)
    EXL2_CHECK(spec.prompt[i] >= 0 && spec.prompt[i] < vocab_, "engine.submit: prompt token ", i, " = ", spec.prompt[i],
               " is outside the vocabulary [0, ", vocab_, ")");
  for (int32_t t : spec.stop_tokens)
    EXL2_CHECK(t >= 0 && t < vocab_, "engine.submit: stop token ", t, " is outside the vocabulary [0, ", vocab_, ")");
  EXL2_CHECK(spec.max_new_tokens >= 0, "engine.submit: max_new_tokens must be >= 0, got ", spec.max_new_tokens);
  EXL2_CHECK(spec.max_rewinds >= -1, "engine.submit: max_rewinds must be >= 0, or -1 for unlimited, got ",
             spec.max_rewinds);
  const int64_t prompt_len = static_cast<int64_t>(spec.prompt.size());
  EXL2_CHECK(prompt_len <= max_seq_len_, "engine.submit: the prompt has ", prompt_len, " tokens but max_seq_len is ",
             max_seq_len_, "; shorten it or load the model with a larger max_seq_len");
  if (spec.sampler.min_tokens > 0)  // min_tokens holds back the job's stop tokens too
    spec.sampler.stop_tokens.insert(spec.sampler.stop_tokens.end(), spec.stop_tokens.begin(), spec.stop_tokens.end());
  spec.sampler.validate(vocab_);

  auto job = std::make_unique<Job>(spec.sampler);
  job->prompt_len = prompt_len;
  job->max_total = std::min(prompt_len + spec.max_new_tokens, max_seq_len_);
  const int64_t ps = options_.page_size;
  job->total_pages = pages_needed(std::max(job->max_total - 1, prompt_len));
  // In tokens of every layer (a grouped cache's pages hold 1 / n_groups of the layers).
  EXL2_CHECK_KIND(OutOfMemory, job->total_pages <= cache_->n_pages(), "engine.submit: the job needs up to ",
                  ceil_div(job->total_pages * ps, n_groups()), " cache tokens (prompt ", prompt_len,
                  " + max_new_tokens ", spec.max_new_tokens, ") but the cache holds ",
                  cache_->n_pages() * ps / n_groups(), "; raise cache_tokens or lower max_new_tokens");
  job->tokens = spec.prompt;
  job->mask = std::move(spec.token_mask);
  job->spec_k = options_.draft_tokens;
  uint64_t parent = kRootHash;
  for (int64_t i = 0; (i + 1) * ps <= prompt_len; ++i) {
    parent = page_hash(parent, job->tokens.data() + i * ps);
    job->hashes.push_back(parent);
  }
  job->spec = std::move(spec);

  std::lock_guard<std::mutex> lock(mutex_);
  job->id = next_id_++;
  job->submit_step = counters_.steps;
  const int64_t id = job->id;
  counters_.jobs_submitted++;
  counters_.tokens_in += prompt_len;
  if (job->max_total <= prompt_len) {  // nothing to generate
    EngineEvent ev;
    ev.job_id = id;
    ev.finished = true;
    ev.finish_reason = "length";
    pending_events_.push_back(std::move(ev));
    counters_.jobs_finished++;
    return id;
  }
  queue_.push_back(id);
  jobs_.emplace(id, std::move(job));
  return id;
}

int64_t job_pages_needed(const CacheLayout& layout, int64_t n_tokens, int64_t page_size, int64_t max_batch_tokens) {
  EXL2_CHECK(n_tokens > 0 && page_size > 0 && max_batch_tokens > 0,
             "job_pages_needed: n_tokens, page_size and max_batch_tokens must be positive, got ", n_tokens, ", ",
             page_size, ", ", max_batch_tokens);
  const int64_t ps = page_size, all = ceil_div(n_tokens, ps);
  int64_t n = 0;
  for (int64_t w : layout.group_window) {
    // A windowed group holds the pages of positions [s - w + 1 - margin, s + rows) in a step of `rows` rows from s
    // (rows <= max_batch_tokens): an interval of w - 1 + margin + rows positions spans at most ceil(../ps) + 1.
    n += w == 0 ? all : std::min(all, ceil_div(w - 1 + kWindowMargin + std::min(max_batch_tokens, n_tokens), ps) + 1);
  }
  return n;
}

int64_t job_cache_tokens(const CacheLayout& layout, int64_t n_tokens, int64_t page_size, int64_t max_batch_tokens) {
  return ceil_div(job_pages_needed(layout, n_tokens, page_size, max_batch_tokens) * page_size,
                  std::max<int64_t>(1, layout.n_groups()));
}

int64_t Engine::pages_needed(int64_t n_tokens) const {
  return job_pages_needed(cache_->layout(), n_tokens, options_.page_size, options_.max_batch_tokens);
}

int64_t Engine::cache_tokens_needed(int64_t n_tokens) const {
  return job_cache_tokens(cache_->layout(), n_tokens, options_.page_size, options_.max_batch_tokens);
}

int64_t Engine::live_from(int64_t group, int64_t n_cached) const {
  const int64_t w = cache_->group_window(group);
  const int64_t lo = n_cached - w + 1 - kWindowMargin;  // the lowest position a row from n_cached on may need
  return w == 0 || lo <= 0 ? 0 : lo / options_.page_size;
}

int64_t Engine::draft_live_from(int64_t d_cached) const {
  const int64_t lo = d_cached - draft_window_ + 1 - kWindowMargin;
  return draft_window_ == 0 || lo <= 0 ? 0 : lo / options_.page_size;
}

void Engine::trim_window(Job& job) {
  PagePool& pool = cache_->pool();
  int64_t freed = 0;
  for (int64_t g = 0; g < n_groups(); ++g) {
    const int64_t to = std::min(live_from(g, job.n_cached), job.n_logical());
    for (int64_t& i = job.first_live[g]; i < to; ++i) {
      int32_t& p = job.pages[g][i];
      if (p >= 0) {
        pool.release(p);
        ++freed;
      }
      p = -1;
    }
  }
  counters_.pages_window_freed += freed;
  const bool decoding = job.n_cached >= job.prompt_len && job.n_cached == static_cast<int64_t>(job.tokens.size()) - 1;
  if (!decoding) {  // still prefilling: its later chunks get these pages back (held + reserved stays its need)
    job.reserved += freed;
    reserved_total_ += freed;
  }
}

int64_t Engine::pages_now(const Job& job) const {
  // Pages held after computing every known token and the first decode row (if the job gets that far); a windowed
  // group's at the largest step.
  const int64_t t = static_cast<int64_t>(job.tokens.size());
  return pages_needed(std::min(t + 1, std::max(job.max_total - 1, t)));
}

int64_t Engine::next_step_pages() const {
  // Called while planning, after the decode rows of this step took their pages: the rows of the step after.
  int64_t n = 0;
  for (int64_t id : active_) {
    const Job& j = *jobs_.at(id);
    if (j.n_cached >= j.prompt_len && j.n_cached == static_cast<int64_t>(j.tokens.size()) - 1)
      n += std::max<int64_t>(0, (ceil_div(j.n_cached + 2 + spec_length(j), options_.page_size) - j.n_logical()) *
                                        n_groups() - j.reserved);
  }
  return n;
}

int64_t Engine::available() const {
  return cache_->pool().n_free() + count_evictable() - reserved_total_;
}

void Engine::extend_hashes(Job& job) {
  const int64_t ps = options_.page_size;
  while (static_cast<int64_t>(job.hashes.size() + 1) * ps <= static_cast<int64_t>(job.tokens.size())) {
    const size_t i = job.hashes.size();
    const uint64_t parent = i == 0 ? kRootHash : job.hashes[i - 1];
    job.hashes.push_back(page_hash(parent, job.tokens.data() + i * ps));
  }
}

bool Engine::try_admit(Job& job) {
  const int64_t ps = options_.page_size;
  PagePool& pool = cache_->pool();
  extend_hashes(job);
  const int64_t last = static_cast<int64_t>(job.tokens.size()) - 1;  // its row is always computed (logits)
  // Cached pages it can take now (never the page holding the last known token).
  const int64_t G = n_groups();
  std::vector<const CacheEntry*> matched;
  if (options_.prefix_cache) {
    uint64_t parent = kRootHash;
    for (int64_t i = 0; (i + 1) * ps <= last; ++i) {
      const CacheEntry* e = lookup(job.hashes[i], parent, job.tokens.data() + i * ps);
      if (!e) break;
      bool full = true;  // full groups read every page: each must still be there
      for (int64_t g = 0; g < G; ++g) full = full && (cache_->group_window(g) > 0 || entry_page(*e, g) >= 0);
      if (!full) break;
      matched.push_back(e);
      parent = job.hashes[i];
    }
    // Windowed groups read the pages inside the window of the adoption point: shorten the match until they are
    // all there (evicting gives them back one by one).
    auto window_ok = [&](int64_t k) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = live_from(g, k * ps); i < k && cache_->group_window(g) > 0; ++i)
          if (entry_page(*matched[i], g) < 0) return false;
      return true;
    };
    while (!matched.empty() && !window_ok(static_cast<int64_t>(matched.size()))) matched.pop_back();
  }
  const int64_t k = static_cast<int64_t>(matched.size());
  int64_t taken = 0, matched_evictable = 0;  // pages it takes from the table, and of those the evictable ones
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = live_from(g, k * ps); i < k; ++i) {
      ++taken;
      if (pool.refcount(entry_page(*matched[i], g)) == 1) ++matched_evictable;
    }
  const int64_t need = std::max<int64_t>(0, pages_now(job) - taken);
  const int64_t avail = available() - matched_evictable - next_step_pages();
  if (need > avail) return false;
  job.pages.assign(G, {});
  job.first_live.assign(G, 0);
  for (int64_t g = 0; g < G; ++g) job.first_live[g] = live_from(g, k * ps);
  for (int64_t i = 0; i < k; ++i) {
    const CacheEntry* e = matched[i];
    for (int64_t g = 0; g < G; ++g) {
      const bool live = i >= job.first_live[g];
      if (live) pool.retain(entry_page(*e, g));
      job.pages[g].push_back(live ? entry_page(*e, g) : -1);
    }
    lru_.splice(lru_.end(), lru_, e->lru);
    job.n_cached += ps;
    if (job.n_cached > job.recompute_until) {
      counters_.tokens_reused += ps;
      job.tokens_reused += ps;
    }
  }
  job.n_registered = k;
  job.reserved = need;
  reserved_total_ += need;
  job.active = true;
  job.requeued = false;
  job.admit_seq = ++admissions_;
  return true;
}

Engine::Job* Engine::pick_victim() {
  Job* victim = nullptr;
  for (int64_t id : active_) {
    Job* j = jobs_.at(id).get();
    if (!victim || j->spec.priority < victim->spec.priority ||
        (j->spec.priority == victim->spec.priority && j->admit_seq > victim->admit_seq))
      victim = j;
  }
  return victim;
}

void Engine::preempt(Job& job, std::vector<Planned>& plan, int64_t& budget) {
  for (auto p = plan.begin(); p != plan.end(); ++p)
    if (p->job == &job) {
      budget += p->len;
      plan.erase(p);
      break;
    }
  release_pages(job);  // its cached pages are touched: its recomputation takes them back soon
  job.recompute_until = std::max(job.recompute_until, job.n_cached);
  job.n_cached = 0;
  job.n_registered = 0;
  job.active = false;
  job.requeued = true;
  job.preempted_step = rounds_;
  active_.erase(std::find(active_.begin(), active_.end(), job.id));
  queue_.push_back(job.id);
  counters_.preemptions++;
}

bool Engine::grow(Job& job, int64_t positions, std::vector<Planned>& plan, int64_t& budget) {
  const int64_t more = ceil_div(positions, options_.page_size) - job.n_logical();  // new pages, in every group
  if (more <= 0) return true;
  const int64_t want = more * n_groups();
  const int64_t own = std::min(want, job.reserved);
  while (want - own > available()) {
    Job* victim = pick_victim();
    if (victim == &job && active_.size() == 1) {  // cannot happen: a lone job fits the pool (submit checks it)
      finish(job, "error",
             "engine: out of cache pages for the only running job (page accounting bug); please report it");
      return false;
    }
    preempt(*victim, plan, budget);
    if (victim == &job) return false;
  }
  job.reserved -= own;
  reserved_total_ -= own;
  std::vector<int32_t> fresh = alloc_pages(want);
  for (int64_t g = 0; g < n_groups(); ++g)
    job.pages[g].insert(job.pages[g].end(), fresh.begin() + g * more, fresh.begin() + (g + 1) * more);
  return true;
}

void Engine::adopt_prefix(Job& job) {
  if (!options_.prefix_cache) return;
  const int64_t ps = options_.page_size;
  extend_hashes(job);
  const int64_t G = n_groups();
  PagePool& pool = cache_->pool();
  bool adopted = false;
  while (job.n_cached % ps == 0 && job.n_logical() == job.n_cached / ps &&
         job.n_cached + ps <= static_cast<int64_t>(job.tokens.size()) - 1 &&
         job.n_cached / ps < static_cast<int64_t>(job.hashes.size())) {
    const int64_t i = job.n_cached / ps;
    const uint64_t parent = i == 0 ? kRootHash : job.hashes[i - 1];
    const CacheEntry* e = lookup(job.hashes[i], parent, job.tokens.data() + i * ps);
    if (!e) break;
    // Every group's page i (inside every window: it holds the position before the adoption point).
    int64_t evictable = 0;
    bool whole = true;
    for (int64_t g = 0; g < G; ++g) {
      const int32_t p = entry_page(*e, g);
      whole = whole && p >= 0;
      if (p >= 0 && pool.refcount(p) == 1) ++evictable;
    }
    if (!whole) break;
    // Taking an evictable page uses up one page the pool could promise: the job's reservation, or a spare one.
    const int64_t covered = std::min<int64_t>(job.reserved, G);
    if (evictable > covered && evictable - covered > available()) break;
    for (int64_t g = 0; g < G; ++g) {
      pool.retain(entry_page(*e, g));
      job.pages[g].push_back(entry_page(*e, g));
    }
    lru_.splice(lru_.end(), lru_, e->lru);
    job.n_cached += ps;
    job.n_registered = i + 1;
    job.reserved -= covered;
    reserved_total_ -= covered;
    if (job.n_cached > job.recompute_until) {
      counters_.tokens_reused += ps;
      job.tokens_reused += ps;
    }
    adopted = true;
  }
  if (adopted) trim_window(job);
}

void Engine::register_complete_pages(Job& job) {
  const int64_t ps = options_.page_size;
  extend_hashes(job);  // hashes of generated pages become known as tokens arrive
  while ((job.n_registered + 1) * ps <= job.n_cached) {
    const int64_t i = job.n_registered++;
    const uint64_t h = job.hashes[i];
    auto p = pending_.find(h);
    if (p != pending_.end() && p->second == job.id) pending_.erase(p);
    if (!options_.prefix_cache || table_.count(h)) continue;  // someone else's copy is already shared
    CacheEntry e;
    e.page = job.pages[0][i];
    for (int64_t g = 1; g < n_groups(); ++g) e.more.push_back(job.pages[g][i]);
    e.parent = i == 0 ? kRootHash : job.hashes[i - 1];
    e.tokens.assign(job.tokens.begin() + i * ps, job.tokens.begin() + (i + 1) * ps);
    e.lru = lru_.insert(lru_.end(), h);
    if (e.page >= 0) cache_->pool().retain(e.page);
    for (int32_t p : e.more)
      if (p >= 0) cache_->pool().retain(p);
    table_.emplace(h, std::move(e));
  }
}

void Engine::release_held(std::unordered_map<uint64_t, CacheEntry>& table, std::list<uint64_t>& lru, PagePool& pool,
                          const std::vector<uint64_t>& hashes, std::vector<int32_t>& pages, int64_t n_registered) {
  for (int64_t i = 0; i < n_registered && i < static_cast<int64_t>(hashes.size()); ++i) {
    auto it = table.find(hashes[i]);
    if (it != table.end() && it->second.page == pages[i]) lru.splice(lru.end(), lru, it->second.lru);
  }
  for (int32_t p : pages)
    if (p >= 0) pool.release(p);  // -1: given back behind a window (draft pages)
  pages.clear();
}

void Engine::release_job_pages(Job& job) {
  if (!cache_->layout().windowed()) {  // one group, every page held
    if (!job.pages.empty()) release_held(table_, lru_, cache_->pool(), job.hashes, job.pages[0], job.n_registered);
  } else {
    for (int64_t i = 0; i < job.n_registered && i < static_cast<int64_t>(job.hashes.size()); ++i) {
      auto it = table_.find(job.hashes[i]);
      if (it == table_.end()) continue;
      bool held = false;  // the table holds the job's copy of page i (some group's page)
      for (int64_t g = 0; g < n_groups(); ++g)
        held = held || (job.pages[g][i] >= 0 && entry_page(it->second, g) == job.pages[g][i]);
      if (held) lru_.splice(lru_.end(), lru_, it->second.lru);
    }
    for (std::vector<int32_t>& gp : job.pages)
      for (int32_t p : gp)
        if (p >= 0) cache_->pool().release(p);
  }
  job.pages.assign(n_groups(), {});
  job.first_live.assign(n_groups(), 0);
}

void Engine::release_pages(Job& job) {
  release_job_pages(job);
  reserved_total_ -= job.reserved;
  job.reserved = 0;
  for (uint64_t h : job.pending_owned) {
    auto p = pending_.find(h);
    if (p != pending_.end() && p->second == job.id) pending_.erase(p);
  }
  job.pending_owned.clear();
  draft_release(job);
}

void Engine::finish(Job& job, const std::string& reason, const std::string& error) {
  release_pages(job);
  EngineEvent ev;
  ev.job_id = job.id;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  ev.spec_proposed = job.spec_proposed;
  ev.spec_accepted = job.spec_accepted;
  ev.tokens_reused = job.tokens_reused;
  pending_events_.push_back(std::move(ev));
  counters_.jobs_finished++;
  const int64_t id = job.id;
  if (job.active)
    active_.erase(std::find(active_.begin(), active_.end(), id));
  else
    queue_.erase(std::find(queue_.begin(), queue_.end(), id));
  jobs_.erase(id);  // `job` is gone now
}

bool Engine::cancel(int64_t job_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return false;
  Job& job = *it->second;
  if (job.cancel_requested) return true;
  if (job.in_flight) {  // its rows are in the forward now: released right after it
    job.cancel_requested = true;
    job.cancel_reason = reason;
  } else {
    finish(job, reason);
  }
  return true;
}

std::vector<EngineEvent> Engine::step() {
  std::unique_lock<std::mutex> step_lock(step_mutex_, std::try_to_lock);
  EXL2_CHECK(step_lock.owns_lock(), "engine.step: called from two threads at once; step from one thread only");

  const bool device_argmax = device_argmax_enabled();  // before planning: a bad value throws with nothing changed
  const bool device_sample = device_sample_enabled();
  bool any_sampled = false;  // a device row draws: the op gets per-row params (else argmax_logprob, as before)
  std::vector<Planned> plan;
  Batch batch;
  DeviceArgmax argmax;  // one flag per logit row
  std::vector<EngineEvent> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t ps = options_.page_size;
    int64_t budget = options_.max_batch_tokens;
    ++rounds_;
    // Who keeps its pages when the pool runs short: higher priority, then earlier admission (pick_victim's order).
    auto by_protection = [this](int64_t a, int64_t b) {
      const Job &x = *jobs_.at(a), &y = *jobs_.at(b);
      return x.spec.priority != y.spec.priority ? x.spec.priority > y.spec.priority : x.admit_seq < y.admit_seq;
    };
    // 1. One decode row for every running job (plus its draft tokens when it speculates), with pages for them
    //    (growing may preempt the least protected job).
    std::vector<int64_t> order;
    for (int64_t id : active_) {
      const Job& j = *jobs_.at(id);
      if (j.n_cached >= j.prompt_len && j.n_cached == static_cast<int64_t>(j.tokens.size()) - 1) order.push_back(id);
    }
    std::stable_sort(order.begin(), order.end(), by_protection);
    for (int64_t id : order) {
      auto it = jobs_.find(id);
      if (it == jobs_.end() || !it->second->active || budget <= 0) continue;  // preempted (or failed) meanwhile
      Job& j = *it->second;
      int64_t k = std::min(spec_length(j), budget - 1);
      std::vector<int32_t> drafts;
      if (k > 0 && options_.ngram_draft) {
        ngram_drafts(j.tokens, options_.ngram_sizes, k, drafts);
        k = static_cast<int64_t>(drafts.size());
      }
      if (k > 0 && draft_ && !draft_prepare(j, k)) k = 0;
      if (!grow(j, j.n_cached + 1 + k, plan, budget)) continue;
      reserved_total_ -= j.reserved;  // past its prefill: what admission promised is used up or not needed
      j.reserved = 0;
      plan.emplace_back(&j, j.n_cached, 1 + k);
      plan.back().n_draft = k;
      plan.back().drafts = std::move(drafts);
      budget -= 1 + k;
    }
    auto by_priority = [this](int64_t a, int64_t b) {
      const Job &x = *jobs_.at(a), &y = *jobs_.at(b);
      const int64_t px = effective_priority(x), py = effective_priority(y);
      if (px != py) return px > py;
      if (x.requeued != y.requeued) return x.requeued;  // preempted jobs go first within their priority
      return a < b;
    };
    // 2. Admit queued jobs by (aged) priority then arrival; the first that does not fit blocks the rest so a big
    //    job is not overtaken forever (a job preempted in this step blocks too: it is not readmitted at once).
    order = queue_;
    std::stable_sort(order.begin(), order.end(), by_priority);
    for (int64_t id : order) {
      if (static_cast<int64_t>(active_.size()) >= options_.max_jobs) break;
      Job& j = *jobs_.at(id);
      if (j.preempted_step == rounds_ || !try_admit(j)) break;
      queue_.erase(std::find(queue_.begin(), queue_.end(), id));
      active_.push_back(id);
    }
    // 3. Prefill chunks by priority then arrival: prompts, and rows a rewind or preemption took back (all but the
    //    last: that one is a decode row).
    order.clear();
    for (int64_t id : active_) {
      const Job& j = *jobs_.at(id);
      if (j.n_cached < j.prompt_len || j.n_cached < static_cast<int64_t>(j.tokens.size()) - 1) order.push_back(id);
    }
    std::stable_sort(order.begin(), order.end(), by_priority);
    for (int64_t id : order) {
      if (budget <= 0) break;
      auto it = jobs_.find(id);
      if (it == jobs_.end() || !it->second->active) continue;  // preempted (or failed) meanwhile
      Job& j = *it->second;
      adopt_prefix(j);
      int64_t len = std::min(static_cast<int64_t>(j.tokens.size()) - j.n_cached, budget);
      // Stop before a full page another job is computing right now: take it when it is complete.
      for (int64_t i = j.n_cached / ps; i * ps < j.n_cached + len && i < static_cast<int64_t>(j.hashes.size()); ++i) {
        if (!options_.prefix_cache) break;
        auto p = pending_.find(j.hashes[i]);
        if (p != pending_.end() && p->second != j.id) {
          len = std::max<int64_t>(0, i * ps - j.n_cached);
          break;
        }
      }
      if (len <= 0) continue;
      if (!grow(j, j.n_cached + len, plan, budget)) continue;
      plan.emplace_back(&j, j.n_cached, len);
      budget -= len;
      if (options_.prefix_cache) {
        for (int64_t i = j.n_cached / ps; i * ps < j.n_cached + len && i < static_cast<int64_t>(j.hashes.size()); ++i) {
          const uint64_t h = j.hashes[i];
          if (!table_.count(h) && !pending_.count(h)) {
            pending_[h] = j.id;
            j.pending_owned.push_back(h);
          }
        }
      }
    }
    // 4. The batch (every planned row has its pages now; draft-model tokens are filled in after run_draft).
    int32_t pages_per_seq = 1;
    for (Planned& p : plan) {
      Job& j = *p.job;
      pages_per_seq = std::max<int32_t>(pages_per_seq, static_cast<int32_t>(j.n_logical()));
      j.in_flight = true;
    }
    batch.pages_per_seq = pages_per_seq;
    // One table per layer group (kv_cache.h CacheLayout); pages given back behind a window read as the scratch
    // page (never inside a row's window).
    const int64_t G = n_groups();
    batch.page_table.assign(G * plan.size() * pages_per_seq, 0);
    for (size_t s = 0; s < plan.size(); ++s) {
      Planned& p = plan[s];
      Job& j = *p.job;
      for (int64_t g = 0; g < G; ++g) {
        auto out = batch.page_table.begin() + (g * static_cast<int64_t>(plan.size()) + s) * pages_per_seq;
        if (j.first_live[g] == 0)
          std::copy(j.pages[g].begin(), j.pages[g].end(), out);
        else
          for (int32_t pg : j.pages[g]) *out++ = pg >= 0 ? pg : cache_->scratch_page();
      }
      p.row0 = static_cast<int32_t>(batch.tokens.size());
      for (int64_t t = p.start; t < p.start + p.len; ++t) {
        const int64_t d = p.n_draft > 0 ? t - p.start - 1 : -1;  // draft index of the row (speculative rows)
        batch.tokens.push_back(d < 0 ? j.tokens[t] : d < static_cast<int64_t>(p.drafts.size()) ? p.drafts[d] : 0);
        batch.positions.push_back(static_cast<int32_t>(t));
        batch.seq_of_token.push_back(static_cast<int32_t>(s));
      }
      if (p.n_draft > 0 || p.start + p.len == static_cast<int64_t>(j.tokens.size())) {
        // The last known token (and its drafts): sample after each. The mask and bans read here are the ones
        // sampling uses: the job is pinned (set_token_mask defers).
        p.logit_row = static_cast<int32_t>(batch.logit_rows.size());
        const bool plain = j.mask.empty() && !(j.spec.constrained && p.n_draft > 0) &&
                           !j.bans.count(static_cast<int64_t>(j.generated.size()));
        // Point-mass drafts only on the device (a sampled draft model's q needs the host's verify).
        const bool point = p.n_draft == 0 || !draft_ || j.sampler.settings().temperature == 0.0f;
        p.sampled = plain && point && device_sample && j.sampler.sampled_plain();
        p.on_device = p.sampled || (plain && device_argmax && j.sampler.greedy_plain());
        any_sampled = any_sampled || p.sampled;
        const int64_t gen = static_cast<int64_t>(j.generated.size());
        for (int64_t i = 0; i <= p.n_draft; ++i) {
          batch.logit_rows.push_back(static_cast<int32_t>(p.row0 + p.len - 1 - p.n_draft + i));
          argmax.rows.push_back(p.on_device ? 1 : 0);
          argmax.params.push_back(p.on_device ? j.sampler.device_params_at(gen + i) : SampleParams{});
        }
      }
      const int64_t recomputed = std::max<int64_t>(0, std::min(p.start + p.len, j.recompute_until) - p.start);
      counters_.tokens_recomputed += recomputed;
      const int64_t first = p.start + recomputed;
      if (first < j.prompt_len) counters_.tokens_prefilled += std::min(p.start + p.len, j.prompt_len) - first;
    }
    if (plan.empty()) {
      events.swap(pending_events_);
      return events;
    }
    counters_.steps++;
  }

  // Forward and sampling run without the state lock: planned jobs are pinned (in_flight) and only this thread
  // touches their tokens, pages and samplers; cancel() only flags them.
  std::string forward_error;
  int64_t draft_forwards = 0;
  std::vector<std::string> sample_errors(plan.size());
  try {
    if (draft_) {
      draft_forwards = run_draft(plan, device_argmax);
      for (Planned& p : plan)
        for (size_t i = 0; i < p.drafts.size(); ++i) batch.tokens[p.row0 + 1 + i] = p.drafts[i];
    }
    // Constrained speculative rows: the masks of their draft positions (the grammar's code, one job at a time).
    for (size_t s = 0; s < plan.size(); ++s) {
      Planned& p = plan[s];
      if (p.n_draft == 0 || (p.job->mask.empty() && !p.job->spec.constrained)) continue;
      try {
        draft_masks(p);
      } catch (const std::exception& e) {
        sample_errors[s] = e.what();
        p.masks.clear();
      }
    }
    Tensor logits;
    if (batch.logit_rows.empty()) {  // prefill-only step: one row (ignored; not even downloaded with the argmax)
      batch.logit_rows.push_back(0);
      argmax.rows.push_back(device_argmax ? 1 : 0);
    }
    if (!any_sampled) argmax.params.clear();  // greedy rows only (or none): ops::argmax_logprob, as before
    const bool any_on_device = std::find(argmax.rows.begin(), argmax.rows.end(), 1) != argmax.rows.end();
    logits = model_.forward(batch, *cache_, any_on_device ? &argmax : nullptr);
    const float* base = logits.data_as<float>();
    // Each job's sampler is independent (own RNG stream, thread-local scratch) and O(vocab) per row (~0.05-2 ms at
    // 32k-128k vocab): the rows are sampled on the CPU pool's threads, with the same tokens as one by one.
    // A job cancelled meanwhile is sampled anyway and discarded. A speculative row samples its positions in order
    // (each over the tokens accepted before it) until one rejects its draft.
    std::vector<size_t> rows;
    for (size_t s = 0; s < plan.size(); ++s)
      if (plan[s].logit_row >= 0) rows.push_back(s);
    cpu::parallel_for(static_cast<int64_t>(rows.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const size_t s = rows[static_cast<size_t>(i)];
        Planned& p = plan[s];
        Job& j = *p.job;
        const size_t n_tokens = j.tokens.size();
        // A constrained row has masks for positions 0 .. last; a draft its grammar refused (d_last, last < n_draft)
        // is still verified there, so that rejection sampling keeps the masked target's distribution (its masked
        // probability is 0: the draw comes from the residual, the masked target itself).
        const bool masked = !j.mask.empty() || j.spec.constrained;
        const int64_t last = masked ? std::min<int64_t>(p.n_draft, static_cast<int64_t>(p.masks.size())) : p.n_draft;
        try {
          for (int64_t d = 0; d <= last; ++d) {
            const int32_t lr = p.logit_row + static_cast<int32_t>(d);
            const int32_t draft = d < p.n_draft ? p.drafts[d] : -1;
            SampleResult r;
            bool accepted = false;
            if (p.on_device) {
              r = j.sampler.take_device(argmax.index[lr], argmax.logprob[lr], vocab_);
              accepted = r.token == draft;
            } else {
              const float* row = base + static_cast<int64_t>(lr) * vocab_;
              auto ban = j.bans.find(static_cast<int64_t>(j.generated.size()));
              if (masked || ban != j.bans.end()) {  // a ban is on plain rows only (such positions do not speculate)
                thread_local std::vector<float> limited;
                limited.assign(row, row + vocab_);
                constexpr float kNegInf = -std::numeric_limits<float>::infinity();
                const std::vector<uint32_t>* m =
                    d == 0 ? &j.mask : masked ? &p.masks[static_cast<size_t>(d - 1)] : nullptr;
                if (m != nullptr && !m->empty())  // constrained: disallowed ids get -inf before the sampler
                  apply_token_mask(*m, limited.data(), vocab_);
                if (ban != j.bans.end())  // banned-string rewinds: ids excluded at this position
                  for (int32_t id : ban->second) limited[id] = kNegInf;
                row = limited.data();
              }
              if (draft < 0) {
                r = j.sampler.sample(row, vocab_, j.tokens, j.generated);
              } else {
                const bool has_q = d < static_cast<int64_t>(p.q.size()) && !p.q[d].empty();
                r = j.sampler.verify(row, vocab_, j.tokens, j.generated, draft, has_q ? &p.q[d] : nullptr,
                                     &accepted);
              }
            }
            const int32_t token = r.token;
            p.out.push_back(std::move(r));
            const bool stop = std::find(j.spec.stop_tokens.begin(), j.spec.stop_tokens.end(), token) !=
                              j.spec.stop_tokens.end();
            if (!accepted || stop) break;
            // A draft accepted at the last masked position (a grammar that refused what its own mask allowed): no
            // mask follows, so it ends the row as its output token (its K/V row is recomputed next step).
            if (d == last) break;
            p.accepted++;
            j.tokens.push_back(token);  // the context of the next position (taken back below)
            j.generated.push_back(token);
          }
        } catch (const std::exception& e) {
          sample_errors[s] = e.what();
        }
        j.generated.resize(j.generated.size() - (j.tokens.size() - n_tokens));
        j.tokens.resize(n_tokens);
      }
    });
  } catch (const std::exception& e) {
    forward_error = e.what();
  }

  std::lock_guard<std::mutex> lock(mutex_);
  counters_.draft_steps += draft_forwards;
  for (size_t s = 0; s < plan.size(); ++s) {
    Planned& p = plan[s];
    Job& j = *p.job;
    j.in_flight = false;
    if (j.has_next_mask) {
      j.mask.swap(j.next_mask);
      j.next_mask.clear();
      j.has_next_mask = false;
    }
    if (!forward_error.empty()) {
      finish(j, "error", forward_error);
      continue;
    }
    // A speculative row keeps the K/V of its last token and the accepted drafts; the rest are dropped.
    j.n_cached = p.n_draft > 0 ? p.start + 1 + p.accepted : p.start + p.len;
    if (p.n_draft > 0) {
      const size_t keep = static_cast<size_t>(ceil_div(j.n_cached + 1, options_.page_size));
      for (std::vector<int32_t>& gp : j.pages) {  // the rejected rows' pages (after every window's start)
        for (size_t i = keep; i < gp.size(); ++i) cache_->pool().release(gp[i]);
        if (gp.size() > keep) gp.resize(keep);
      }
      if (draft_) j.d_cached = std::min(j.d_cached, j.n_cached);
    }
    if (j.cancel_requested) {
      finish(j, j.cancel_reason);
      continue;
    }
    if (p.logit_row < 0) {
      register_complete_pages(j);
      trim_window(j);
      continue;
    }
    if (!sample_errors[s].empty()) {
      finish(j, "error", sample_errors[s]);
      continue;
    }
    if (p.n_draft > 0) {
      spec_update(j, p.n_draft, p.accepted);
      counters_.spec_proposed += p.n_draft;
      counters_.spec_accepted += p.accepted;
    }
    const size_t n_before = j.tokens.size();
    for (const SampleResult& r : p.out) {
      j.tokens.push_back(r.token);
      j.generated.push_back(r.token);
    }
    register_complete_pages(j);
    trim_window(j);
    if (draft_) draft_trim(j);
    for (size_t e = 0; e < p.out.size(); ++e) {
      SampleResult& r = p.out[e];
      counters_.tokens_out++;
      if (p.on_device) (p.sampled ? counters_.tokens_device_sampled : counters_.tokens_device_argmax)++;
      EngineEvent ev;
      ev.job_id = j.id;
      ev.token = r.token;
      ev.logprob = r.logprob;
      ev.top = std::move(r.top);
      ev.spec_proposed = j.spec_proposed;
      ev.spec_accepted = j.spec_accepted;
      ev.tokens_reused = j.tokens_reused;
      const bool stop =
          std::find(j.spec.stop_tokens.begin(), j.spec.stop_tokens.end(), r.token) != j.spec.stop_tokens.end();
      const bool length = static_cast<int64_t>(n_before + e + 1) >= j.max_total;
      if (stop || length) {
        // The token rides on the finished event.
        j.tokens.resize(n_before + e + 1);
        j.generated.resize(j.generated.size() - (p.out.size() - e - 1));
        const std::string reason = stop ? "stop_token" : "length";
        finish(j, reason);
        EngineEvent& fin = pending_events_.back();
        fin.token = ev.token;
        fin.logprob = ev.logprob;
        fin.top = std::move(ev.top);
        break;
      }
      pending_events_.push_back(std::move(ev));
    }
  }
  events.swap(pending_events_);
  return events;
}

bool Engine::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return jobs_.empty() && pending_events_.empty();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  EngineStats s = counters_;
  const PagePool& pool = cache_->pool();
  s.pages_total = pool.n_pages();
  s.pages_free = pool.n_free();
  s.pages_used = pool.n_used();
  s.pages_cached = 0;  // pages in the prefix table (a cache of layer groups: an entry holds one per group)
  s.pages_reserved = reserved_total_;
  std::vector<char> in_table(pool.n_pages(), 0);
  for (const auto& kv : table_) {
    auto mark = [&](int32_t p) {
      if (p < 0) return;
      in_table[p] = 1;
      s.pages_cached++;
      if (pool.refcount(p) == 1) s.pages_evictable++;
    };
    mark(kv.second.page);
    for (int32_t p : kv.second.more) mark(p);
  }
  s.layer_groups = n_groups();
  for (int64_t p = 0; p < pool.n_pages(); ++p)
    if (pool.refcount(static_cast<int32_t>(p)) - in_table[p] >= 2) s.pages_shared++;
  s.jobs_queued = static_cast<int64_t>(queue_.size());
  s.jobs_active = static_cast<int64_t>(active_.size());
  if (draft_cache_) {
    s.draft_pages_total = draft_cache_->pool().n_pages();
    s.draft_pages_free = draft_cache_->pool().n_free();
    s.draft_pages_cached = static_cast<int64_t>(dtable_.size());
    s.draft_pages_window_freed = counters_.draft_pages_window_freed;
  }
  return s;
}

int64_t Engine::clear_prefix_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t freed = evict(table_, lru_, cache_->pool(), std::numeric_limits<int64_t>::max());
  return freed + (draft_cache_ ? evict(dtable_, dlru_, draft_cache_->pool(), std::numeric_limits<int64_t>::max()) : 0);
}

bool Engine::set_token_mask(int64_t job_id, std::vector<uint32_t> mask) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return false;
  Job& j = *it->second;
  if (j.in_flight) {
    j.next_mask = std::move(mask);
    j.has_next_mask = true;
  } else {
    j.mask = std::move(mask);
  }
  return true;
}

bool Engine::rewind(int64_t job_id, int64_t keep, int32_t ban) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return false;
  Job& j = *it->second;
  const int64_t n_gen = static_cast<int64_t>(j.generated.size());
  if (j.in_flight || j.cancel_requested || (!j.active && n_gen == 0)) return false;
  EXL2_CHECK(keep >= 0 && keep < n_gen, "engine.rewind: keep must be in [0, ", n_gen, ") (generated tokens of job ",
             job_id, "), got ", keep);
  EXL2_CHECK(ban >= -1 && ban < vocab_, "engine.rewind: ban must be -1 or a token id in [0, ", vocab_, "), got ", ban);
  if (j.spec.max_rewinds >= 0 && j.rewinds >= j.spec.max_rewinds) {
    finish(j, "banned_string_limit");  // `j` is gone now
    return false;
  }
  const int64_t ps = options_.page_size;
  const int64_t kept = j.prompt_len + keep;  // L: tokens kept; K/V of positions [0, L - 1) stay
  j.tokens.resize(static_cast<size_t>(kept));
  j.generated.resize(static_cast<size_t>(keep));
  j.sampler.set_step(keep);
  j.bans.erase(j.bans.upper_bound(keep), j.bans.end());
  if (ban >= 0) j.bans[keep].push_back(ban);
  j.rewinds++;
  counters_.rewinds++;
  j.recompute_until = std::min(j.recompute_until, kept - 1);
  j.hashes.resize(std::min<size_t>(j.hashes.size(), static_cast<size_t>(kept / ps)));
  for (uint64_t h : j.pending_owned) {
    auto p = pending_.find(h);
    if (p != pending_.end() && p->second == j.id) pending_.erase(p);
  }
  j.pending_owned.clear();
  int64_t target = kept - 1;   // new n_cached: position L - 1 is recomputed for the logits
  if (draft_ && j.d_cached > target && draft_live_from(target / ps * ps) < j.d_first_live)
    draft_release(j);  // its catch-up would read a draft page given back behind the window: from position 0
  if (draft_ && j.d_cached > target) {  // the draft's KV back to a page boundary at or before it (caught up later)
    j.d_cached = target / ps * ps;
    for (int64_t i = static_cast<int64_t>(j.dpages.size()) - 1; i >= j.d_cached / ps; --i)
      draft_cache_->pool().release(j.dpages[i]);
    j.dpages.resize(static_cast<size_t>(j.d_cached / ps));
    j.d_registered = std::min(j.d_registered, j.d_cached / ps);
  }
  if (target >= j.n_cached) {  // nothing computed there (preempted and queued, or mid-recomputation): tokens only
    j.n_registered = std::min(j.n_registered, j.n_cached / ps);
    return true;
  }

  PagePool& pool = cache_->pool();
  const int64_t G = n_groups();
  const int64_t d = target / ps;  // the page written next (< n_logical(): target < n_cached)
  int64_t keep_pages = d + 1;
  // The prefix-table entry of the job's copy of page d (each of its pages is the job's, or evicted), if any.
  auto e = d < static_cast<int64_t>(j.hashes.size()) ? table_.find(j.hashes[d]) : table_.end();
  if (e != table_.end()) {
    bool mine = false;
    for (int64_t g = 0; g < G; ++g) {
      const int32_t ep = entry_page(e->second, g);
      if (ep >= 0 && ep != j.pages[g][d]) e = table_.end();
      if (e == table_.end()) break;
      mine = mine || ep >= 0;
    }
    if (e != table_.end() && !mine) e = table_.end();
  }
  bool shared = false;  // another job holds page d: recompute the kept part of the page into a fresh one
  for (int64_t g = 0; g < G; ++g) {
    const int32_t p = j.pages[g][d];
    if (p < 0) continue;  // given back (behind the window): the check below recomputes the job
    const bool in_table = e != table_.end() && entry_page(e->second, g) == p;
    shared = shared || pool.refcount(p) - (in_table ? 1 : 0) >= 2;
  }
  if (shared) {
    target = d * ps;
    keep_pages = d;
  }
  // Windowed groups: the recomputed rows read the pages from live_from(target) on; one given back means the job
  // recomputes from position 0 (engine.h Sliding windows).
  bool window_ok = true;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = live_from(g, target); i < keep_pages && window_ok; ++i) window_ok = j.pages[g][i] >= 0;
  if (!window_ok) {
    release_job_pages(j);
    j.recompute_until = std::max(j.recompute_until, target);
    j.n_cached = 0;
    j.n_registered = 0;
    return true;
  }
  if (!shared && e != table_.end()) {  // only the table shares it: the table lets it go
    for (int64_t g = 0; g < G; ++g)
      if (entry_page(e->second, g) >= 0) pool.release(entry_page(e->second, g));
    lru_.erase(e->second.lru);
    table_.erase(e);
  }
  // Pages after it: freed, or left evictable in the table (the job takes pages again as it grows).
  for (std::vector<int32_t>& gp : j.pages) {
    for (int64_t i = static_cast<int64_t>(gp.size()) - 1; i >= keep_pages; --i) pool.release(gp[i]);
    gp.resize(static_cast<size_t>(keep_pages));
  }
  j.n_cached = target;
  j.n_registered = std::min(j.n_registered, target / ps);
  return true;
}

std::vector<int32_t> Engine::job_tokens(int64_t job_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? std::vector<int32_t>{} : it->second->tokens;
}

std::vector<int32_t> Engine::job_pages(int64_t job_id, int64_t group) const {
  std::lock_guard<std::mutex> lock(mutex_);
  EXL2_CHECK(group >= 0 && group < n_groups(), "engine.job_pages: group must be in [0, ", n_groups(), "), got ",
             group);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second->pages.empty()) return {};
  return it->second->pages[group];
}

}  // namespace exl2
