//! `cargo bench -p specd-model --bench detokenize`: what streaming a generation's text costs
//! per token as the output grows, on the default model's tokenizer (fetched once). A stream
//! decoder turns each new token id into the text it completes; the orchestrator runs one per
//! request on every accepted token. The baseline column is a decode of the whole output so
//! far, which is what a decoder that re-reads everything pays on each token; the stream
//! decoder should cost the same at every length. Medians of repeated runs.

use std::time::Instant;

use candle_core::quantized::gguf_file;
use specd_model::TextTokenizer;

/// Output lengths (tokens) at which the per-token cost is read.
const LENGTHS: [usize; 4] = [64, 512, 2048, 4096];
/// Tokens pushed per measurement, ending at each length.
const WINDOW: usize = 32;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let path = specd_model::fetch::ensure_default_model().expect("fetch the default model");
    let mut file = std::fs::File::open(&path).expect("open the model");
    let content = gguf_file::Content::read(&mut file).expect("read the GGUF header");
    let tokenizer = TextTokenizer::from_gguf(&content).expect("build the tokenizer");
    // A long mixed output: prose, code, JSON and multi-byte text, repeated past 4096 tokens.
    let text = "The plan adds twelve kilometres of protected lanes.\n\
                def add(a, b):\n    return a + b\n\
                {\"firstName\": \"Ada\", \"birthYear\": 1815}\n\
                café résumé 日本語のテキスト 😀🚀👍🏽\n";
    let mut ids = Vec::new();
    while ids.len() < LENGTHS[LENGTHS.len() - 1] {
        ids.extend(tokenizer.encode(text).expect("encode"));
    }
    let reps = 9;
    println!(
        "{:>8} {:>22} {:>26}",
        "tokens", "stream push us/token", "whole-output decode us"
    );
    for &n in &LENGTHS {
        let stream = median(
            (0..reps)
                .map(|_| {
                    let mut decoder = tokenizer.stream_decoder();
                    for &id in &ids[..n - WINDOW] {
                        decoder.push(id).expect("decode");
                    }
                    let started = Instant::now();
                    for &id in &ids[n - WINDOW..n] {
                        std::hint::black_box(decoder.push(id).expect("decode"));
                    }
                    started.elapsed().as_secs_f64() / WINDOW as f64
                })
                .collect(),
        );
        let whole = median(
            (0..reps)
                .map(|_| {
                    let started = Instant::now();
                    std::hint::black_box(tokenizer.decode(&ids[..n]).expect("decode"));
                    started.elapsed().as_secs_f64()
                })
                .collect(),
        );
        println!("{n:>8} {:>22.2} {:>26.2}", stream * 1e6, whole * 1e6);
    }
}
