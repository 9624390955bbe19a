// Reference outputs from llama.cpp for specd's agreement tests (an independent implementation
// of the same GGUF). Built and driven by make_fixtures.py; not part of specd itself.
//
//   llama_reference MODEL tokenize          < NUL-separated texts  -> one line of ids per text
//   llama_reference MODEL generate N TOPK   < NUL-separated prompts
//       per prompt: "prompt <ids>", then "top <pos> <id>:<logit> ..." for every prompt
//       position, then "greedy <id>:<margin> ..." (N tokens, one decode call per token; margin =
//       top-1 minus top-2 logit, so a comparison can tell near-ties from disagreements).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

static char *read_all(size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, stdin)) > 0) {
        n += r;
        if (n == cap) { cap *= 2; buf = realloc(buf, cap); }
    }
    *len = n;
    return buf;
}

static int tokenize(const struct llama_vocab *vocab, const char *text, int len, llama_token *out, int max) {
    return llama_tokenize(vocab, text, len, out, max, true, true);
}

static void print_top(const float *logits, int n_vocab, int k, int pos) {
    printf("top %d", pos);
    int *best = malloc(sizeof(int) * k);
    for (int j = 0; j < k; j++) best[j] = -1;
    for (int i = 0; i < n_vocab; i++) {
        for (int j = 0; j < k; j++) {
            if (best[j] < 0 || logits[i] > logits[best[j]]) {
                memmove(best + j + 1, best + j, sizeof(int) * (k - j - 1));
                best[j] = i;
                break;
            }
        }
    }
    for (int j = 0; j < k; j++) printf(" %d:%.6f", best[j], logits[best[j]]);
    printf("\n");
    free(best);
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL tokenize|generate N TOPK\n", argv[0]); return 2; }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    size_t len;
    char *input = read_all(&len);
    llama_token *ids = malloc(sizeof(llama_token) * 65536);
    int generate = strcmp(argv[2], "generate") == 0;
    int n_gen = generate ? atoi(argv[3]) : 0, top_k = generate ? atoi(argv[4]) : 0;
    for (size_t start = 0; start < len;) {
        size_t end = start;
        while (end < len && input[end] != '\0') end++;
        int n = tokenize(vocab, input + start, (int)(end - start), ids, 65536);
        if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        if (!generate) {
            for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
            printf("\n");
        } else {
            struct llama_context_params cp = llama_context_default_params();
            cp.n_ctx = 2048; cp.n_batch = 2048; cp.n_threads = 2; cp.n_threads_batch = 2;
            // f32 KV cache, no flash attention: specd keeps K/V in f32, and so must the reference.
            cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
            cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            struct llama_context *ctx = llama_init_from_model(model, cp);
            printf("prompt");
            for (int i = 0; i < n; i++) printf(" %d", ids[i]);
            printf("\n");
            struct llama_batch batch = llama_batch_init(n, 0, 1);
            for (int i = 0; i < n; i++) {
                batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1;
                batch.seq_id[i][0] = 0; batch.logits[i] = 1;
            }
            batch.n_tokens = n;
            if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
            for (int i = 0; i < n; i++) print_top(llama_get_logits_ith(ctx, i), n_vocab, top_k, i);
            printf("greedy");
            llama_token next = 0;
            const float *last = llama_get_logits_ith(ctx, n - 1);
            for (int g = 0; g < n_gen; g++) {
                next = 0;
                for (int v = 1; v < n_vocab; v++) if (last[v] > last[next]) next = v;
                int second = next == 0 ? 1 : 0;
                for (int v = 0; v < n_vocab; v++) if (v != next && last[v] > last[second]) second = v;
                printf(" %d:%.4f", next, last[next] - last[second]);
                struct llama_batch one = llama_batch_get_one(&next, 1);
                if (llama_decode(ctx, one) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
                last = llama_get_logits_ith(ctx, -1);
            }
            printf("\n");
            llama_batch_free(batch);
            llama_free(ctx);
        }
        fflush(stdout);
        start = end + 1;
    }
    llama_model_free(model);
    return 0;
}
