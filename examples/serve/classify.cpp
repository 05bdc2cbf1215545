// Serving an exported SST Tree-LSTM from C++, with no Python: classify trees read from stdin.
//
//   cortexc export examples/binary_treelstm.cell -o dist --params trained.safetensors
//   make -C examples/serve EXPORT=$PWD/dist/binary_treelstm OUT=$PWD/build
//   echo "4 4 3 -1 3 : 1 2 7 0 0" | build/classify dist/binary_treelstm/params.safetensors
//
// One tree per line: the parent of every node (-1 for the root), a colon, and a word id per node (ids of
// internal nodes are ignored by the cell but must be in range).  Prints, per tree, the sentiment class of
// its root (argmax of the root's logits).  A batch of all the lines runs as one forward: every node of a
// level, across all the trees, in one batched kernel.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "BinaryTreeLSTM.h"

namespace {

struct ModelDeleter {
    void operator()(BinaryTreeLSTM_model *model) const { BinaryTreeLSTM_free(model); }
};

struct Tree {
    std::vector<int32_t> parents;
    std::vector<int32_t> words;
};

int fail(const std::string &message)
{
    std::cerr << "classify: " << message << "\n";
    return 1;
}

}  // namespace

int main(int argc, char **argv)
{
    if (argc != 2) return fail("usage: classify PARAMS.safetensors < trees");
    char error[BINARYTREELSTM_ERROR_SIZE];
    BinaryTreeLSTM_model *raw = nullptr;
    if (BinaryTreeLSTM_load(argv[1], &raw, error, sizeof error) != 0) return fail(error);
    std::unique_ptr<BinaryTreeLSTM_model, ModelDeleter> model(raw);

    // the trees of stdin, concatenated into one forest (node ids shifted by the nodes before them)
    std::vector<int32_t> parents, words;
    std::vector<int64_t> roots_of_lines;
    std::string line;
    for (int number = 1; std::getline(std::cin, line); ++number) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) return fail("line " + std::to_string(number) + ": expected PARENTS : WORDS");
        Tree tree;
        std::istringstream left(line.substr(0, colon)), right(line.substr(colon + 1));
        for (int32_t value; left >> value;) tree.parents.push_back(value);
        for (int32_t value; right >> value;) tree.words.push_back(value);
        if (tree.parents.empty() || tree.parents.size() != tree.words.size())
            return fail("line " + std::to_string(number) + ": one parent and one word id per node");
        const auto offset = static_cast<int32_t>(parents.size());
        for (auto p : tree.parents) parents.push_back(p < 0 ? p : p + offset);
        words.insert(words.end(), tree.words.begin(), tree.words.end());
    }
    const auto n = static_cast<int64_t>(parents.size());
    BinaryTreeLSTM_forest forest{};
    forest.num_nodes = n;
    forest.parents = parents.data();
    BinaryTreeLSTM_inputs inputs{};
    inputs.word = words.data();
    inputs.word_rows = n;
    BinaryTreeLSTM_result result;
    if (BinaryTreeLSTM_forward(model.get(), &forest, &inputs, &result, error, sizeof error) != 0) return fail(error);
    // roots come in increasing node order, so in the order of the lines
    for (int64_t k = 0; k < result.num_roots; ++k) {
        const float *logits = result.logits + result.roots[k] * BINARYTREELSTM_LOGITS_WIDTH;
        int best = 0;
        for (int c = 1; c < BINARYTREELSTM_LOGITS_WIDTH; ++c)
            if (logits[c] > logits[best]) best = c;
        std::printf("tree %lld label %d\n", static_cast<long long>(k), best);
    }
    BinaryTreeLSTM_result_free(&result);
    return 0;
}
