// The work plan of paged_attention: items, decode kv ranges (splits, shared prefixes), their order.
//
// Work items: a prefill item is (sequence, tile of query rows, range of kv heads); a decode item is
// (sequence, range of kv heads, kv range). All kv heads by default, so an item streams whole token rows
// of its blocks. Split rule, when the batch gives fewer than 2 items per thread: first each decode row
// of at least 2 * kMinSplit positions is cut into up to ceil(2 * threads / items) block-aligned kv
// ranges (none shorter than kMinSplit), then, if still short, the kv heads of every item are dealt
// into groups. split_tokens > 0 forces kv ranges of that many positions (tests, tuning). Items run
// longest first (dynamic scheduling over torch's thread pool).
//
// Shared prefixes (prefix caching: decode rows whose block tables start with the same blocks) are
// reread by every such row. Their decode items cover head groups small enough that one group's shared
// K/V fits half an L2, and run group by group: a worker fetches the shared blocks of a group from
// L3/DRAM once instead of once per sequence (whole-row items stream 64 x 1.5 MB through L2 for 64
// rows over a 512-token bf16 prefix of 12 heads x 64), and items skip the software prefetch of those
// positions. A row whose unshared tail is long is cut at the end of the prefix; the tails run after
// all shared ranges, so their streaming does not evict the shared blocks.
//
// Cascade (the default): consecutive decode rows whose tables start with the same >= kMinCascade
// positions form a run. Its prefix is attended by cascade items (a kv head x up to kCascadeRows query
// rows of the run x a kv range), which read each shared K/V row once for all their sequences; each row
// attends its own tail alone, and the reduce combines the parts. The L2 grouping above remains for
// shared prefixes that form no run (cascade off, or sharing too short).
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "attention.h"

namespace kvf {
namespace {

constexpr int64_t kMinSplit = 256;
constexpr int64_t kMinCascade = 64;    // shared positions for a cascade run
constexpr int64_t kCascadeRows = 256;  // most query rows (sequences x G) of one cascade item
constexpr int64_t kPrefillStateBytes = 1 << 20;  // per-head qt + O of a prefill item stay in L2

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of K/V that one worker should keep for reuse across decode items: half its L2.
int64_t l2_budget() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? int64_t(l2) / 2 : int64_t(1) << 20;
  }();
  return bytes;
}

// Per sequence: how many leading block ids its decode row shares with the previous or the next decode
// row (prefix caching: many sequences reading the same prompt blocks); 0 for prefill rows.
std::vector<int32_t> shared_prefix_blocks(const int32_t* qsl, const int32_t* lens, const int32_t* bt,
                                          int64_t bt_stride, int64_t batch, int block_size) {
  std::vector<int32_t> shared(batch, 0);
  int64_t prev = -1;
  for (int64_t b = 0; b < batch; ++b) {
    if (qsl[b + 1] - qsl[b] != 1 || lens[b] == 0) continue;
    if (prev >= 0) {
      const int64_t nb = ceil_div(std::min(lens[b], lens[prev]), block_size);
      int32_t k = 0;
      while (k < nb && bt[b * bt_stride + k] == bt[prev * bt_stride + k]) ++k;
      shared[b] = k;
      shared[prev] = std::max(shared[prev], k);
    }
    prev = b;
  }
  return shared;
}

// Consecutive decode rows (prefill rows may lie between) whose tables start with the same full blocks,
// at least kMinCascade positions of them: (rows, shared positions) per run of two or more.
struct Run {
  std::vector<int32_t> seqs;
  int32_t prefix = 0;
};

std::vector<Run> cascade_runs(const int32_t* qsl, const int32_t* lens, const int32_t* bt, int64_t bt_stride,
                              int64_t batch, int block_size) {
  std::vector<Run> runs;
  Run cur;
  auto close = [&](int32_t next) {
    if (cur.seqs.size() >= 2) runs.push_back(cur);
    cur = Run{{next}, 0};
  };
  for (int32_t b = 0; b < batch; ++b) {
    if (qsl[b + 1] - qsl[b] != 1 || lens[b] == 0) continue;
    if (cur.seqs.empty()) {
      cur.seqs = {b};
      continue;
    }
    const int64_t a = cur.seqs[0], nb = std::min(lens[a], lens[b]) / block_size;  // full blocks only
    int32_t k = 0;
    while (k < nb && bt[a * bt_stride + k] == bt[b * bt_stride + k]) ++k;
    const int32_t common = k * block_size;
    if (cur.seqs.size() == 1 ? common >= kMinCascade : common >= cur.prefix) {
      if (cur.seqs.size() == 1) cur.prefix = common;
      cur.seqs.push_back(b);
    } else {
      close(b);
    }
  }
  close(0);
  return runs;
}

// The runs of a batch and how they are cut: per member, its own kv starts at the prefix and the first
// `extra` of its splits are the run's; per run (sub-runs, kv span of one cascade item).
struct Cascade {
  std::vector<Run> runs;
  std::vector<int32_t> start, extra;
  std::vector<std::pair<int64_t, int64_t>> shape;
  int64_t items = 0;
  explicit Cascade(int64_t batch) : start(batch, 0), extra(batch, 0) {}
};

Cascade plan_cascade(const int32_t* qsl, const int32_t* lens, const int32_t* bt, int64_t bt_stride, int64_t batch,
                     int block_size, int hkv, int group, int64_t target, int64_t split_tokens) {
  Cascade c(batch);
  c.runs = cascade_runs(qsl, lens, bt, bt_stride, batch, block_size);
  for (const Run& r : c.runs) {
    const int64_t subruns = ceil_div(int64_t(r.seqs.size()) * group, kCascadeRows), items = hkv * subruns;
    int64_t splits = 1;  // enough items for the threads, none shorter than kMinSplit
    if (items < target) splits = std::min(ceil_div(target, items), std::max<int64_t>(1, r.prefix / kMinSplit));
    const int64_t span = split_tokens > 0 ? split_tokens : round_up(ceil_div(r.prefix, splits), block_size);
    splits = ceil_div(r.prefix, span);
    c.shape.emplace_back(subruns, span);
    c.items += items * splits;
    for (const int32_t b : r.seqs) {
      c.start[b] = r.prefix;
      c.extra[b] = int32_t(splits);
    }
  }
  return c;
}

// The cascade items of a run: per sub-run (consecutive members, at most kCascadeRows query rows), kv head
// and kv range of the prefix `span` long; Plan::cascade gets each sub-run's members once.
void add_cascade_items(Plan& p, const Run& r, std::pair<int64_t, int64_t> shape,
                       const std::vector<CascadeSeq>& member, int hkv, int group) {
  const auto [subruns, span] = shape;
  const int64_t n = int64_t(r.seqs.size()), per = ceil_div(n, subruns);
  for (int64_t s0 = 0; s0 < n; s0 += per) {
    const int32_t count = int32_t(std::min(per, n - s0));
    p.cascade_rows = std::max<int>(p.cascade_rows, int(round_up(int64_t(count) * group, kCascadeGroup)));
    const int32_t run0 = int32_t(p.cascade.size());
    for (int32_t i = 0; i < count; ++i) p.cascade.push_back(member[r.seqs[s0 + i]]);
    for (int32_t h = 0; h < hkv; ++h) {
      int32_t split = 0;
      for (int64_t k0 = 0; k0 < r.prefix; k0 += span, ++split) {
        WorkItem it{};
        it.kv0 = int32_t(k0);
        it.kv1 = int32_t(std::min<int64_t>(r.prefix, k0 + span));
        it.cost = int64_t(it.kv1 - it.kv0) * count * group + 64;
        it.seq = r.seqs[s0];
        it.head = h;
        it.nh = 1;
        it.nq = 1;
        it.split = split;
        it.run0 = run0;
        it.run_n = count;
        p.items.push_back(it);
      }
    }
  }
}

}  // namespace

Plan make_plan(const int32_t* qsl, const int32_t* lens, const int32_t* bt, int64_t bt_stride, int64_t batch,
               int64_t num_tokens, int hkv, int group, int head_dim, int block_size, int64_t elem_size,
               int64_t split_tokens, int64_t window, bool cascade) {
  Plan p;
  p.tile_rows = std::max(1, kTileRows / group);
  int64_t covered = 0, prefill_items = 0, decode_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = qsl[b], q1 = qsl[b + 1], len = lens[b];
    TORCH_CHECK(q0 >= covered && q1 >= q0 && q1 <= num_tokens, "query_start_loc must be non-decreasing in [0, T]");
    TORCH_CHECK(len >= q1 - q0, "seq_lens[", b, "] = ", len, " is shorter than its ", q1 - q0, " queries");
    if (q0 > covered) p.zero_rows.emplace_back(covered, q0);
    covered = q1;
    if (q1 == q0) continue;
    if (len == 0) {
      p.zero_rows.emplace_back(q0, q1);
      continue;
    }
    if (q1 - q0 == 1) {
      ++decode_rows;
    } else {
      prefill_items += ceil_div(q1 - q0, p.tile_rows);
    }
  }
  if (covered < num_tokens) p.zero_rows.emplace_back(covered, num_tokens);
  const int64_t target = 2 * at::get_num_threads();
  const int64_t base = std::max<int64_t>(1, prefill_items + decode_rows);
  const int64_t auto_splits = base < target ? ceil_div(target, base) : 1;
  auto splits_of = [&](int64_t len) -> std::pair<int64_t, int64_t> {  // (splits, span)
    int64_t splits = 1;
    if (split_tokens > 0) {
      splits = ceil_div(len, split_tokens);
    } else if (auto_splits > 1 && len >= 2 * kMinSplit) {
      splits = std::min<int64_t>(auto_splits, len / kMinSplit);
    }
    const int64_t span = round_up(ceil_div(len, splits), split_tokens > 0 ? 1 : block_size);
    return {ceil_div(len, span), span};
  };
  // Decode kv ranges: a row whose leading blocks are shared with its neighbours is one range of hot
  // (shared) positions followed by a short tail, or, when the tail is longer than a quarter of the
  // shared part (streaming it would evict the shared blocks from L2 between two sequences), is cut at
  // the end of the shared prefix into a shared and an unshared range. Each range is split as above.
  std::vector<int32_t> shared_blocks = shared_prefix_blocks(qsl, lens, bt, bt_stride, batch, block_size);
  const Cascade cas = cascade && window == 0
                          ? plan_cascade(qsl, lens, bt, bt_stride, batch, block_size, hkv, group, target, split_tokens)
                          : Cascade(batch);
  const std::vector<int32_t>& start = cas.start;
  const std::vector<int32_t>& extra = cas.extra;
  for (const Run& r : cas.runs)
    for (const int32_t b : r.seqs) shared_blocks[b] = 0;  // their prefix is the run's, not L2-grouped
  std::vector<CascadeSeq> member(batch);
  // Shared ranges run in head groups whose shared K/V fits the L2 budget; single-head groups stream
  // worse than the L2 reuse saves (measured on 8 kv heads x 128 fp32): no shared handling then.
  int64_t shared = 0, group_heads = hkv;
  for (const int32_t k : shared_blocks) shared = std::max<int64_t>(shared, k);
  if (shared > 0) {
    const int64_t fit = std::min<int64_t>(l2_budget() / (shared * block_size * head_dim * 2 * elem_size), hkv);
    if (fit >= std::min<int64_t>(2, hkv)) {
      group_heads = ceil_div(hkv, ceil_div(hkv, fit));
    } else {
      shared = 0;
      std::fill(shared_blocks.begin(), shared_blocks.end(), 0);
    }
  }
  struct Range {
    int32_t kv0, kv1;
    bool shared;  // starts with the shared prefix (positions below hot are expected in cache)
  };
  std::vector<Range> ranges;
  int32_t hot = 0;
  // A windowed row attends [w0, len): the shared prefix counts only from w0 on.
  auto ranges_of = [&](int64_t b) {
    ranges.clear();
    const int32_t len = lens[b];
    const int32_t w0 = window > 0 ? int32_t(std::max<int64_t>(0, len - window)) : 0;
    hot = std::min(len, shared_blocks[b] * block_size);
    if (hot <= w0) hot = 0;
    auto add = [&](int32_t k0, int32_t k1, bool sh) {
      const auto [splits, span] = splits_of(k1 - k0);
      for (int64_t sp = 0; sp < splits; ++sp)
        ranges.push_back({int32_t(k0 + sp * span), int32_t(std::min<int64_t>(k1, k0 + (sp + 1) * span)), sh});
    };
    if (hot > 0 && 4 * int64_t(len - hot) <= hot - w0) {
      add(w0, len, true);
    } else {
      if (hot > 0) add(w0, hot, true);
      const int32_t k0 = std::max({hot, w0, start[b]});
      if (k0 < len) add(k0, len, false);
    }
  };
  int64_t total = prefill_items + cas.items;
  for (int64_t b = 0; b < batch; ++b) {
    if (qsl[b + 1] - qsl[b] != 1 || lens[b] == 0) continue;
    ranges_of(b);
    total += int64_t(ranges.size());
  }
  const int64_t groups =
      total < target ? std::min<int64_t>(hkv, ceil_div(target, std::max<int64_t>(total, 1))) : 1;
  p.heads = static_cast<int>(ceil_div(hkv, groups));
  const int64_t state = 8 * round_up(head_dim, W) * round_up(int64_t(p.tile_rows) * group, W);
  p.prefill_heads = static_cast<int>(std::clamp<int64_t>(kPrefillStateBytes / state, 1, p.heads));
  p.decode_heads = static_cast<int>(std::min<int64_t>(p.heads, group_heads));
  p.l2_groups = shared > 0;

  for (int64_t b = 0; b < batch; ++b) {
    const int32_t q0 = qsl[b], nq = qsl[b + 1] - q0, len = lens[b];
    if (nq == 0 || len == 0) continue;
    const int32_t pos0 = len - nq;
    if (nq > 1) {
      for (int32_t r = 0; r < nq; r += p.tile_rows) {
        const int32_t rows = std::min(p.tile_rows, nq - r);
        for (int32_t h0 = 0; h0 < hkv; h0 += p.prefill_heads) {
          const int32_t nh = std::min(p.prefill_heads, hkv - h0);
          const int32_t kv0 = window > 0 ? int32_t(std::max<int64_t>(0, pos0 + r - window + 1)) : 0;
          const int64_t cost = int64_t(rows) * group * nh * (pos0 + r - kv0 + rows / 2 + 1) + 64;
          p.items.push_back({cost, int32_t(b), h0, nh, q0 + r, rows, pos0 + r, kv0, pos0 + r + rows, -1, 1, 0});
        }
      }
      continue;
    }
    ranges_of(b);
    const int32_t own = extra[b], splits = own + int32_t(ranges.size());  // the run's splits come first
    const int32_t slot0 = p.num_partials;  // partial slot of (kv head h, range s): slot0 + h * splits + s
    member[b] = {q0, slot0, splits};
    if (splits > 1 || own > 0) {
      p.num_partials += hkv * splits;
      for (int32_t h = 0; h < hkv; ++h) p.reduces.push_back({int32_t(b), h, q0, slot0 + h * splits, splits});
    }
    for (int32_t sp = 0; sp < int32_t(ranges.size()); ++sp) {
      const Range& rg = ranges[sp];
      const int heads = rg.shared ? p.decode_heads : p.heads;
      for (int32_t h0 = 0; h0 < hkv; h0 += heads) {
        const int32_t nh = std::min(heads, hkv - h0);
        const int64_t cost = int64_t(rg.kv1 - rg.kv0) * nh * group + 64;
        p.items.push_back({cost, int32_t(b), h0, nh, q0, 1, pos0, rg.kv0, rg.kv1,
                           splits > 1 || own > 0 ? own + sp : -1, splits, slot0 + h0 * splits,
                           rg.shared ? std::min(hot, rg.kv1) : 0});
      }
    }
  }
  for (size_t r = 0; r < cas.runs.size(); ++r) add_cascade_items(p, cas.runs[r], cas.shape[r], member, hkv, group);
  // Longest first; with shared prefixes: prefill items and unshared decode rows, then the shared ranges
  // head group by head group (longest first inside), so the workers reuse a group's blocks while they
  // are in their L2, then the unshared tails of the sharing rows (streamed, they would evict them).
  const auto rank = [&](const WorkItem& x) {
    if (!p.l2_groups || x.nq != 1 || (x.hot == 0 && shared_blocks[x.seq] == 0)) return 0;
    return x.hot > 0 ? 1 + x.head : 1 + hkv;
  };
  std::stable_sort(p.items.begin(), p.items.end(), [&](const WorkItem& x, const WorkItem& y) {
    return rank(x) != rank(y) ? rank(x) < rank(y) : x.cost > y.cost;
  });
  return p;
}

}  // namespace kvf
