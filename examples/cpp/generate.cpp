// A C++ host that links the exl2cpp runtime, loads a model and generates greedily from token ids.
//   exl2_generate MODEL_DIR [--device cpu|cuda:0] [--max-new-tokens N] ID [ID ...]
// Tokenization lives in Python (HF tokenizers); a C++ host brings its own or passes ids.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "exl2/model.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [--device D] [--max-new-tokens N] ID [ID ...]\n", argv[0]);
    return 2;
  }
  exl2::LoadOptions opt;
  int max_new = 16;
  std::vector<int32_t> ids;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      opt.device = exl2::Device::parse(argv[++i]);
    } else if (a == "--max-new-tokens" && i + 1 < argc) {
      max_new = std::atoi(argv[++i]);
    } else {
      ids.push_back(static_cast<int32_t>(std::atol(a.c_str())));
    }
  }
  try {
    auto model = exl2::Model::load(argv[1], opt);
    const int64_t total = static_cast<int64_t>(ids.size()) + max_new;
    auto cache = model->make_cache(total, 256);
    exl2::Batch batch;
    batch.page_table = cache->pool().alloc((total + cache->page_size() - 1) / cache->page_size());
    batch.pages_per_seq = static_cast<int32_t>(batch.page_table.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      batch.tokens.push_back(ids[i]);
      batch.positions.push_back(static_cast<int32_t>(i));
      batch.seq_of_token.push_back(0);
    }
    batch.logit_rows = {static_cast<int32_t>(ids.size()) - 1};
    const int64_t vocab = model->config().vocab_size;
    for (int step = 0; step < max_new; ++step) {
      exl2::Tensor logits = model->forward(batch, *cache);
      const float* row = logits.data_as<float>();
      const int32_t next = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      std::printf("%d%s", next, step + 1 < max_new ? " " : "\n");
      std::fflush(stdout);
      const int32_t pos = batch.positions.back() + 1;
      batch.tokens = {next};
      batch.positions = {pos};
      batch.seq_of_token = {0};
      batch.logit_rows = {0};
    }
  } catch (const exl2::Error& e) {
    std::fprintf(stderr, "error (%s): %s\n", exl2::error_kind_name(e.kind()), e.what());
    return 1;
  }
  return 0;
}
