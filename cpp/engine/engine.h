// The serving engine: a job queue over one paged KV cache that plans each forward step (decode rows of running
// jobs plus prefill chunks of new ones under a token budget), samples every job with its own Sampler, detects stop
// conditions, shares full pages between jobs through a chained-hash prefix cache with LRU eviction, and preempts
// (requeues for recomputation) the lowest-priority job when the pool runs out of pages.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/sampler.h"
#include "exl2/kv_cache.h"
#include "exl2/model.h"

namespace exl2 {

struct EngineOptions {
  int64_t cache_tokens = 16384;     // page pool size in tokens (rounded up to whole pages)
  int page_size = 256;              // tokens per page
  int64_t max_batch_tokens = 2048;  // rows per forward step (decode rows + prefill chunks)
  int64_t max_jobs = 0;             // jobs holding pages at once (<= max_batch_tokens: each decodes one row);
                                    // 0: min(128, max_batch_tokens)
  int64_t aging_steps = 16;         // a waiting job's effective priority rises by 1 every aging_steps steps
  bool prefix_cache = true;         // share full pages between jobs with equal token prefixes
  std::string cache_type = "auto";  // KV cache storage: auto (fp32 CPU / fp16 CUDA), fp16, fp32, q8, q6, q4
  // Speculative decoding (see "Speculative decoding" below): n-gram drafts here, or a draft Model given to the
  // constructor; not both.
  bool ngram_draft = false;                      // drafts from earlier occurrences of the job's last n tokens
  std::vector<int32_t> ngram_sizes = {4, 3, 2};  // n-gram lengths tried in this order (first match wins): [1, 64]
  int32_t draft_tokens = 4;  // most draft tokens per job and step (the adaptive length starts here): [1, 32].
                             // With drafts, max_jobs * (draft_tokens + 1) <= max_batch_tokens (0: as many jobs
                             // as fit, at most 128), so every running job always gets its rows
  void validate() const;     // InvalidArgument naming the field
};

// What a caller submits. Stop strings, banned strings and text are the Python layer's business (it calls cancel()
// with reason "stop_string", and rewind() for a banned string); the engine sees token ids only.
struct JobSpec {
  std::vector<int32_t> prompt;       // >= 1 id in [0, vocab)
  int64_t max_new_tokens = 256;      // >= 0; also capped so prompt + generated <= model max_seq_len
  std::vector<int32_t> stop_tokens;  // generation ends after emitting one of these (it is reported in the event)
  SamplerSettings sampler;           // validated against the vocabulary at submit; with min_tokens > 0 the
                                     // stop_tokens above join its stop_tokens (held back until min_tokens)
  int32_t priority = 0;              // higher first (for admission and prefill order; decodes always run); the
                                     // lowest is preempted first when the pool runs short
  int32_t max_rewinds = 16;          // >= -1: Engine::rewind calls allowed (banned strings); the next one ends the
                                     // job with "banned_string_limit" instead; -1 = unlimited
  // Constrained decoding (grammar / JSON schema): when non-empty, only ids whose bit is set (bit id % 32 of word
  // id / 32) can be sampled; ids past the mask's end count as not allowed. Applied to the logits before the
  // sampler (so before bias/penalties/filters). Replace it between steps with Engine::set_token_mask.
  std::vector<uint32_t> token_mask;
  // Speculative decoding for this job when the engine drafts (false: plain decoding rows only). A job with a token
  // mask speculates only when the engine has a DraftMaskFn (Engine::set_draft_masks): the masks of its draft
  // positions come from there.
  bool speculate = true;
  // The job's mask comes from a constraint that can change at every position and may lift itself at some (an empty
  // mask there: every token allowed), e.g. a reasoning budget. With a DraftMaskFn such a job speculates also while
  // its current mask is empty: the function's masks cover its draft positions, an empty one allowing every token.
  bool constrained = false;
};

// One step's news for one job. A job gets events with tokens as they are sampled and exactly one event with
// finished = true (which may also carry the last token, or token = -1 when it ended without one: cancel, error,
// max_new_tokens = 0).
struct EngineEvent {
  int64_t job_id = -1;
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // SampleResult::top
  bool finished = false;
  std::string finish_reason;  // "stop_token" | "length" | "cancelled" | caller's cancel reason | "error" |
                              // "banned_string_limit" (JobSpec::max_rewinds reached)
  std::string error;          // for "error": the message
  int64_t spec_proposed = 0;  // the job's draft tokens verified so far (speculative decoding)
  int64_t spec_accepted = 0;  // ... and accepted
  int64_t tokens_reused = 0;  // the job's prompt tokens taken from shared pages so far (prefix cache)
};

// The masks of a constrained job's draft positions, for speculative decoding under a grammar: called with the job's
// id and its drafts d_0 .. d_{k-1} (k >= 1), it returns masks m_1 .. m_n (n <= k; JobSpec::token_mask layout), m_i
// the job's token mask after d_0 .. d_{i-1} follow its tokens so far, exactly the mask set_token_mask would get in
// plain decoding once those tokens were sampled. It stops at the first draft its grammar does not accept (d_n, when
// n < k), and leaves the grammar's own state as it was (a copy or a rollback). Called by step() on its thread,
// without the engine's lock, one job at a time: while a draft model proposes (the drafts so far, to mask the next
// proposal) and once with all of a row's drafts before its verify forward; an exception there fails that job
// (reason "error"; while proposing, the draft proposes unmasked instead).
using DraftMaskFn =
    std::function<std::vector<std::vector<uint32_t>>(int64_t job_id, const std::vector<int32_t>& drafts)>;

struct EngineStats {
  int64_t pages_total = 0, pages_used = 0, pages_free = 0;
  int64_t pages_shared = 0;     // pages referenced by two or more jobs
  int64_t pages_cached = 0;     // pages in the prefix table (complete, hashed)
  int64_t pages_evictable = 0;  // cached pages no job references (freed LRU-first when the pool runs short)
  int64_t pages_reserved = 0;   // pages promised to admitted jobs (prefill + first decode row) not yet allocated
  int64_t jobs_queued = 0, jobs_active = 0, jobs_submitted = 0, jobs_finished = 0;
  int64_t tokens_in = 0;          // prompt tokens submitted
  int64_t tokens_prefilled = 0;   // prompt tokens computed by forward
  int64_t tokens_reused = 0;      // prompt tokens taken from shared pages instead
  int64_t tokens_out = 0;         // tokens sampled
  int64_t tokens_device_argmax = 0;  // of those, greedy tokens picked on the logits' device (option device_argmax)
  int64_t tokens_device_sampled = 0;  // of those, sampled tokens drawn on the logits' device (option device_sample)
  int64_t steps = 0;              // forward passes run
  int64_t rewinds = 0;            // Engine::rewind calls that took tokens back
  int64_t preemptions = 0;        // jobs sent back to the queue to free pages (see Memory)
  int64_t tokens_recomputed = 0;  // rows forwarded again for preempted jobs (prefix-cache hits excluded)
  int64_t spec_proposed = 0;      // draft tokens verified by the target (speculative decoding)
  int64_t spec_accepted = 0;      // of those, accepted (each also counts in tokens_out)
  int64_t draft_steps = 0;        // draft model forward passes
  int64_t draft_pages_total = 0, draft_pages_free = 0, draft_pages_cached = 0;  // the draft model's cache
  int64_t draft_pages_window_freed = 0;  // draft pages jobs gave back behind the draft model's window
  int64_t layer_groups = 1;        // page tables per sequence (kv_cache.h CacheLayout; > 1: sliding windows)
  int64_t pages_window_freed = 0;  // pages jobs gave back because they fell behind their group's window
};

// The most pool pages a job of `n_tokens` positions holds at once in a cache of `layout` (kv_cache.h CacheLayout)
// with pages of page_size tokens and steps of at most max_batch_tokens rows: every page of a full group, at most
// the window + kWindowMargin + a step's rows of a windowed one (see "Sliding windows"). Engine::pages_needed.
int64_t job_pages_needed(const CacheLayout& layout, int64_t n_tokens, int64_t page_size, int64_t max_batch_tokens);
// The same in tokens of every layer (as EngineOptions::cache_tokens counts them): pages * page_size / n_groups.
int64_t job_cache_tokens(const CacheLayout& layout, int64_t n_tokens, int64_t page_size, int64_t max_batch_tokens);

// Thread safety: submit, cancel, stats, idle may be called from any thread at any time. step() must be called from
// one thread at a time (a second concurrent call throws InvalidArgument); it releases the state lock during the
// forward pass and sampling, so submit/cancel never wait for a forward.
//
// Memory: a job larger than the whole pool (worst case prompt + max_new_tokens, capped by max_seq_len) is refused at
// submit with OutOfMemory. Otherwise it is admitted when what it needs now fits: the pages for its known tokens
// (prompt, plus generated ones when resuming) and its first decode row, less the cached pages it can take, plus the
// pages the running jobs' next decode rows need (headroom), counting free and evictable pages minus what other
// admitted jobs still have reserved. Admitted jobs take pages as they grow (a decode row crossing into a new page,
// a prefill chunk). When a job cannot get a page, the engine preempts a victim: the active job with the lowest
// priority (JobSpec::priority, not aged), the most recently admitted among equals; possibly the requester itself,
// never the only active job (which always fits: see submit). The victim's pages are released (full pages in the
// prefix table stay there, evictable, so that its recomputation takes them back for free), it keeps its tokens,
// sampler (RNG step), bans and token mask, and goes back to the queue ahead of the jobs of its (aged) priority; no
// victim is readmitted in the step that preempted it. On readmission it recomputes prompt + generated tokens as a
// prefill (cached pages adopted), whose last row samples its next token: events continue where they stopped, the
// same tokens as without preemption (the sampler's draw depends on the job's seed and token index only).
//
// Sliding windows: a model with windowed layers gets a cache of layer groups (Model::make_cache(.., windowed),
// kv_cache.h CacheLayout: same memory as cache_tokens of every layer, n_groups() times the pages of n_slots()
// layers), so a job holds one page per group for each page of its positions. In a windowed group (window w) a job
// keeps only the pages holding positions >= n_cached - w + 1 - kWindowMargin: after each step the pages before are
// given back (EngineStats::pages_window_freed). Full groups keep every page. What a job needs (admission,
// reservation, submit's check, pages_needed) counts per group: a full group its positions' pages, a windowed one
// at most its window + margin + one step's rows. Speculative rows roll back only their own rejected rows (never
// below the step's first row), so they need no page given back. A rewind (banned strings) within the margin keeps
// its pages; one further back, where a windowed group gave back a page the recomputed rows would read, drops all
// the job's pages and recomputes the job from position 0 (prefix pages adopted as for a preemption). A shared
// prefix page holds every group's page; evicting gives back windowed groups' pages that no job holds one by one,
// and a job adopts cached pages only while its windowed groups' pages inside the window of the adoption point are
// still there. The draft model's cache is always one group; when every layer of the draft model has a window
// (Model::kv_window, the largest w), a job's draft pages before d_cached - w + 1 - kWindowMargin are given back
// after each step (EngineStats::draft_pages_window_freed; they read as the scratch page), and a rewind whose
// draft catch-up would read one of them drops the job's draft pages (its draft recomputes from position 0).
//
// Prefix sharing: page i of a job is hashed h_i = H(h_{i-1}, tokens of page i) once all its page_size tokens are
// written to the cache; the table maps h_i to the page (holding one reference). A job's prompt page i (entirely
// before its last prompt token, which is always computed to produce logits) whose hash is in the table is retained
// instead of computed. A page being computed in the same or a running step by another job (pending) makes the job
// wait for it instead of duplicating work. Tokens are compared on a hash hit, so a collision cannot share wrong KV.
//
// Speculative decoding: with drafts on (EngineOptions::ngram_draft, or a draft model), a running job's decode row
// becomes [last token, d_1 .. d_k] (k <= its adaptive draft length, and short of max_new_tokens), verified by one
// forward whose k + 1 logit rows are sampled in order, each exactly as plain decoding samples that position (same
// pipeline, penalties over the tokens accepted so far, the step's RNG draw): greedy jobs produce exactly the tokens
// of plain decoding; sampled jobs with point-mass drafts (n-gram drafts, greedy draft models) too, token for token,
// since accepting a draft iff the draw equals it is rejection sampling for q = delta(draft); a sampled draft model
// draws d_i from its own distribution q under the job's settings and the target accepts it with probability
// min(1, p/q), else draws from max(0, p - q) renormalized (Sampler::verify), so the output follows the target's
// distribution. The first rejected position yields the target's token there, all accepted yield a bonus token from
// the last row. The K/V of rejected positions are dropped (the job's n_cached goes back; pages past it are freed).
// Decode rows are planned first and max_jobs bounds them (EngineOptions::draft_tokens), so a job's draft length
// depends on its own history only and seeded jobs stay reproducible whatever runs alongside.
// Adaptive length: it starts at draft_tokens; all k accepted -> k + 1 (capped), m of k (0 < m < k) -> m + 1, none
// -> k / 2; at 0 the job drafts nothing for 8 generated tokens, then probes with one draft token; each failed probe
// doubles that wait (up to 256), an accepted draft resets it.
// Constrained jobs (a token mask) speculate when a DraftMaskFn is set: a draft model proposes under the job's mask
// and then the function's masks after its drafts so far; after the drafts are known (n-gram lookup or draft model)
// and before the verify forward, the function gives the masks of positions 1 .. n (position 0 has the job's mask).
// Positions 0 .. n are verified, each under the mask plain decoding would apply there, so a draft the grammar
// forbids (d_n, when n < k) is rejected at its position (its probability under the masked target is 0; rejection
// sampling then draws from the masked target itself) and the row ends there. A draft accepted at position n
// nonetheless (a grammar that refused a token its own mask allows) ends the row as its last token. Greedy
// constrained jobs give the tokens of plain constrained decoding; sampled ones keep the masked target's
// distribution (and with n-gram drafts its very tokens for the same seed).
// Not speculated (plain rows): jobs with JobSpec::speculate false, a token mask without a DraftMaskFn, a position
// with a rewind ban, the first token after a (re)computed prompt, and with a draft model sampled (temperature > 0)
// jobs with mirostat (its mu would have to follow draft tokens). DRY, penalties, XTC and the rest apply exactly
// (per position, over the accepted context).
// Draft model: a Model of the same vocabulary with its own KV cache (cache_tokens, page_size, cache_type) of its
// own pages and prefix table (same chained hashes; shared full pages are adopted as in the target). A job's draft
// KV catches up lazily: before drafting, the draft forwards the job's tokens it has not seen (in chunks of at most
// max_batch_tokens rows), then one row per further draft token. When the draft's pool cannot hold a job's rows even
// after evicting its cached pages, that job drafts nothing that step. Cancellation, preemption, finishing and
// rewinds release the draft's pages with the target's.
class Engine {
 public:
  // Allocates the cache (model.make_cache); with draft_model (not owned; it must outlive the engine) also the
  // draft's cache. InvalidArgument when the draft's vocabulary size or max_seq_len does not match, or when both
  // ngram_draft and a draft model are given.
  Engine(Model& model, const EngineOptions& options, Model* draft_model = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a job; returns its id (>= 1, increasing). Throws InvalidArgument for a bad spec (empty or out-of-vocab
  // prompt, prompt beyond max_seq_len, sampler settings) and OutOfMemory when the job could never fit the pool.
  int64_t submit(JobSpec spec);
  // End a queued or active job now: its pages are released at once (after the forward, if it is in one now) and a
  // finished event with `reason` follows. False when the id is unknown or already finished.
  bool cancel(int64_t job_id, const std::string& reason = "cancelled");
  // Replace a job's token mask (see JobSpec::token_mask; empty lifts it). It applies from the next token sampled
  // for the job; call it between steps (e.g. while handling the job's events) so that token sees it. If the job is
  // in a step right now the mask is kept and applied when that step ends. False when the id is unknown/finished.
  bool set_token_mask(int64_t job_id, std::vector<uint32_t> mask);
  // Take back the generated tokens of an active job from generated index `keep` on (0 <= keep < generated count)
  // and resample that position with `ban` (an id in [0, vocab), or -1) excluded there: the banned-strings rewind
  // of the Python layer. Call it between steps (e.g. while handling the job's events).
  //   - Tokens: the job keeps prompt + generated[0, keep); its sampler step goes back to `keep` (so the RNG draw of
  //     each position is the same whatever was rewound) and its bans at generated indices > keep are dropped (the
  //     text they were made for is gone); `ban` joins the bans of index `keep`, which stay while the job does not
  //     rewind before `keep`. The next token of the job is sampled at index `keep` from logits recomputed for its
  //     last kept token (one catch-up row).
  //   - Cache: with L = kept tokens, positions [0, L - 1) stay; the page holding position L - 1 is rewritten, so
  //     it must be the job's alone: when the prefix table also holds it (and no other job) the table lets it go;
  //     when another job shares it, the job drops it and recomputes that page's kept positions into a fresh page.
  //     Pages after it are released (back to the free list, or evictable in the prefix table when cached). Shared
  //     pages are never written. The job takes pages again as it grows (see Memory).
  //   - A preempted job waiting in the queue is rewound in its tokens only (it holds no pages).
  //   - Cap: when the job has already been rewound JobSpec::max_rewinds times, it is finished instead with reason
  //     "banned_string_limit" (event at the next step) and false is returned.
  // Returns false when the id is unknown, finished, queued without generated tokens, in a step now, or at its
  // rewind cap. Throws InvalidArgument for `keep` or `ban` out of range.
  bool rewind(int64_t job_id, int64_t keep, int32_t ban);
  // Plan and run one forward step (when any job has work) and return the events of this step plus any pending
  // ones (cancels, zero-token jobs). Forward/sampler errors finish the jobs of that step with reason "error".
  // Rows of plain greedy jobs (Sampler::greedy_plain, no token mask or rewind ban there) are picked on the logits'
  // device and only (token, logprob) is copied back: option device_argmax, read by device_argmax_enabled()
  // in engine.cpp (default on; the same tokens and logprobs, bit-identical on the CPU backend). Rows of plain sampled
  // jobs (Sampler::sampled_plain, same conditions) are drawn there too (ops::sample_logprob, u from the job's host
  // RNG): option device_sample, read by device_sample_enabled() in engine.cpp (default off until measured on
  // a GPU; bit-identical tokens and logprobs on the CPU backend).
  std::vector<EngineEvent> step();
  // True when no job is queued or active and no event is pending.
  bool idle() const;
  EngineStats stats() const;
  // Masks of constrained jobs' draft positions (see DraftMaskFn and "Speculative decoding"); empty: constrained jobs
  // do not speculate. Set it before the first submit (InvalidArgument after): step() calls it without a lock.
  void set_draft_masks(DraftMaskFn fn);
  // Drop every cached page no job references; returns how many were freed.
  int64_t clear_prefix_cache();
  // The tokens (prompt + generated) of an active or queued job (empty when unknown); for tests.
  std::vector<int32_t> job_tokens(int64_t job_id) const;
  // The page ids an active job holds in layer group `group` (empty when none), -1 for pages given back behind the
  // group's window; for tests.
  std::vector<int32_t> job_pages(int64_t job_id, int64_t group = 0) const;
  // Capacity planning: the most pool pages a job of `n_tokens` positions holds at once (every layer group; a
  // windowed group holds its window, the margin and a step's rows); what submit checks against the pool.
  int64_t pages_needed(int64_t n_tokens) const;
  int64_t cache_tokens_needed(int64_t n_tokens) const;  // the same in tokens of every layer (job_cache_tokens)

  const EngineOptions& options() const { return options_; }
  KVCache& cache() { return *cache_; }
  KVCache* draft_cache() { return draft_cache_.get(); }  // null without a draft model
  Model& model() { return model_; }

 private:
  struct Job;
  struct CacheEntry {
    int32_t page = -1;         // layer group 0's page (-1: evicted while another group's is still held)
    std::vector<int32_t> more;  // a cache of layer groups: groups 1.. in order (-1: evicted)
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    std::list<uint64_t>::iterator lru;
  };

  // All private helpers expect mutex_ held.
  struct Planned;
  bool try_admit(Job& job);
  int64_t pages_now(const Job& job) const;
  int64_t next_step_pages() const;
  int64_t available() const;
  bool grow(Job& job, int64_t positions, std::vector<Planned>& plan, int64_t& budget);
  Job* pick_victim();
  void preempt(Job& job, std::vector<Planned>& plan, int64_t& budget);
  void extend_hashes(Job& job);
  void adopt_prefix(Job& job);
  void register_complete_pages(Job& job);
  // Gives back a job's pages (its cached ones touched in the LRU), its reservation and its pending prefix claims.
  void release_pages(Job& job);
  // Sliding windows (kv_cache.h CacheLayout): the first logical page group g must keep for rows from position
  // n_cached on (its window plus kWindowMargin behind it), and trim_window gives back a job's pages before it
  // (a job still prefilling keeps them promised: its reservation grows by what it gives back).
  int64_t live_from(int64_t group, int64_t n_cached) const;
  void trim_window(Job& job);
  void release_job_pages(Job& job);  // every group's pages (registered ones touched in the LRU)
  int64_t n_groups() const { return cache_->n_groups(); }
  int32_t entry_page(const CacheEntry& e, int64_t group) const { return group == 0 ? e.page : e.more[group - 1]; }
  void finish(Job& job, const std::string& reason, const std::string& error = "");
  std::vector<int32_t> alloc_pages(int64_t n);
  // Drops table entries only the table references, least recently used first, until `pool` has `want_free` free
  // pages (INT64_MAX: all of them); returns how many were dropped. For the model's table and the draft's.
  static int64_t evict(std::unordered_map<uint64_t, CacheEntry>& table, std::list<uint64_t>& lru, PagePool& pool,
                       int64_t want_free);
  // Releases `pages` (cleared), touching in the LRU first those of the first n_registered that the table holds, so
  // that recently used prefixes are evicted last.
  static void release_held(std::unordered_map<uint64_t, CacheEntry>& table, std::list<uint64_t>& lru, PagePool& pool,
                           const std::vector<uint64_t>& hashes, std::vector<int32_t>& pages, int64_t n_registered);
  int64_t count_evictable() const;
  uint64_t page_hash(uint64_t parent, const int32_t* tokens) const;
  const CacheEntry* lookup(uint64_t hash, uint64_t parent, const int32_t* tokens) const;
  int64_t effective_priority(const Job& job) const;
  // Speculative decoding (engine_spec.cpp).
  bool drafting() const { return options_.ngram_draft || draft_ != nullptr; }
  bool spec_allowed(const Job& job) const;
  int64_t spec_length(const Job& job) const;  // draft tokens for its next decode row (before the n-gram lookup)
  void spec_update(Job& job, int64_t proposed, int64_t accepted);
  bool draft_prepare(Job& job, int64_t k);  // draft pages for k draft tokens (adopting cached ones); false: none
  // Draft pages past its d_cached back; complete ones registered; with a draft window (Model::kv_window), the pages
  // before draft_live_from(d_cached) given back too.
  void draft_trim(Job& job);
  int64_t draft_live_from(int64_t d_cached) const;
  void draft_release(Job& job);
  // Fills the drafts of the plan's draft-model rows (no lock held; jobs pinned); returns the draft forwards run.
  int64_t run_draft(std::vector<Planned>& plan, bool device_argmax);
  // The masks of a constrained speculative row's draft positions (Planned::masks) from draft_masks_ (no lock held).
  void draft_masks(Planned& p);

  Model& model_;
  EngineOptions options_;
  std::unique_ptr<KVCache> cache_;
  int64_t vocab_ = 0;
  int64_t max_seq_len_ = 0;

  mutable std::mutex mutex_;
  std::mutex step_mutex_;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::unique_ptr<Job>> jobs_;  // queued and active
  std::vector<int64_t> queue_;                              // queued ids, arrival order
  std::vector<int64_t> active_;                             // admitted ids, admission order
  std::vector<EngineEvent> pending_events_;
  std::unordered_map<uint64_t, CacheEntry> table_;  // prefix cache: chained hash -> complete page
  std::list<uint64_t> lru_;                         // table hashes, least recently used first
  std::unordered_map<uint64_t, int64_t> pending_;   // hash -> job computing that page now
  int64_t reserved_total_ = 0;
  int64_t admissions_ = 0;  // admission sequence (Job::admit_seq)
  int64_t rounds_ = 0;      // step() calls that planned (Job::preempted_step)
  EngineStats counters_;
  // Draft model (null without one): its cache and prefix table (hash -> page of draft_cache_).
  Model* draft_ = nullptr;
  std::unique_ptr<KVCache> draft_cache_;
  int64_t draft_window_ = 0;  // draft_->kv_window(): 0 keeps every draft page
  std::unordered_map<uint64_t, CacheEntry> dtable_;
  std::list<uint64_t> dlru_;
  DraftMaskFn draft_masks_;  // constrained jobs' draft masks (set_draft_masks); empty: they do not speculate
};

}  // namespace exl2
