//! Prometheus metrics under SGLang's names and labels, so dashboards and
//! `bench_one_batch_server`'s scrapes keep working. SGLang labels the scheduler's series
//! (gauges, `spec_verify_calls_total`, queue time) `model_name`, `engine_type`, `tp_rank`,
//! `pp_rank` and `moe_ep_rank`; the tokenizer's request series `model_name` and `engine_type`,
//! the per-request counters and latency histograms adding `is_streaming` ("true"/"false").
//!
//! Each server owns its recorder instead of installing a process-global one: tests start several
//! servers in one process, and a global recorder would mix their counters.

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

const METADATA: Metadata<'static> = Metadata::new("dflash_serve", Level::INFO, None);

/// Latency buckets (seconds), as SGLang's histograms use for TTFT / E2E.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

pub struct ServerMetrics {
    recorder: PrometheusRecorder,
    /// The tokenizer manager's labels.
    labels: Vec<Label>,
    /// The scheduler's: `labels` plus the (single) ranks.
    scheduler_labels: Vec<Label>,
}

/// Which of SGLang's label sets a series carries.
#[derive(Clone, Copy)]
enum Labels {
    Tokenizer,
    Streaming(bool),
    Scheduler,
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").finish_non_exhaustive()
    }
}

/// What a finished request reports.
#[derive(Debug, Clone, Copy)]
pub struct FinishedRequest {
    pub prompt_tokens: usize,
    /// Of the prompt tokens, those found in the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub e2e: Duration,
    pub ttft: Option<Duration>,
    pub aborted: bool,
    pub streaming: bool,
}

impl ServerMetrics {
    pub fn new(model_name: &str) -> Self {
        // Bucket lists are non-empty constants, so the builder cannot refuse them; fall back to
        // summaries rather than fail startup if it ever did.
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Suffix("_histogram".into()), TOKEN_BUCKETS)
            })
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let labels = vec![
            Label::new("model_name", model_name.to_string()),
            Label::new("engine_type", "unified"),
        ];
        let mut scheduler_labels = labels.clone();
        for rank in ["tp_rank", "pp_rank", "moe_ep_rank"] {
            scheduler_labels.push(Label::new(rank, "0"));
        }
        let this = Self {
            recorder: builder.build_recorder(),
            labels,
            scheduler_labels,
        };
        // Register every series up front so a scrape before the first request sees them at 0.
        for name in STREAMING_COUNTERS {
            for streaming in [false, true] {
                this.counter(name, Labels::Streaming(streaming)).absolute(0);
            }
        }
        for name in TOKENIZER_COUNTERS {
            this.counter(name, Labels::Tokenizer).absolute(0);
        }
        this.counter("sglang:spec_verify_calls_total", Labels::Scheduler)
            .absolute(0);
        for name in GAUGES {
            this.gauge(name).set(0.0);
        }
        this
    }

    fn key(&self, name: &'static str, labels: Labels) -> Key {
        let mut set = match labels {
            Labels::Scheduler => self.scheduler_labels.clone(),
            Labels::Tokenizer | Labels::Streaming(_) => self.labels.clone(),
        };
        if let Labels::Streaming(streaming) = labels {
            set.push(Label::new(
                "is_streaming",
                if streaming { "true" } else { "false" },
            ));
        }
        Key::from_parts(name, set)
    }

    fn counter(&self, name: &'static str, labels: Labels) -> Counter {
        self.recorder
            .register_counter(&self.key(name, labels), &METADATA)
    }

    /// Gauges are the scheduler's.
    fn gauge(&self, name: &'static str) -> Gauge {
        self.recorder
            .register_gauge(&self.key(name, Labels::Scheduler), &METADATA)
    }

    fn histogram(&self, name: &'static str, labels: Labels) -> Histogram {
        self.recorder
            .register_histogram(&self.key(name, labels), &METADATA)
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.recorder.handle().render()
    }

    /// `draft_tokens` tokens verified per round (`ServeConfig::spec_num_draft_tokens`) from
    /// `num_steps` drafter calls (DFLASH drafts a block in 1 step, NEXTN one token per step);
    /// both 0 without speculation.
    pub fn set_static(
        &self,
        context_len: usize,
        max_total_num_tokens: usize,
        draft_tokens: usize,
        num_steps: usize,
    ) {
        self.gauge("sglang:context_len").set(context_len as f64);
        self.gauge("sglang:max_total_num_tokens")
            .set(max_total_num_tokens as f64);
        self.gauge("sglang:spec_num_draft_tokens")
            .set(draft_tokens as f64);
        self.gauge("sglang:spec_num_steps").set(num_steps as f64);
    }

    pub fn request_received(&self, prompt_tokens: usize, streaming: bool) {
        let l = Labels::Streaming(streaming);
        self.counter("sglang:num_requests_total", l).increment(1);
        self.counter("sglang:prompt_tokens_total", l)
            .increment(prompt_tokens as u64);
        self.histogram("sglang:prompt_tokens_histogram", Labels::Tokenizer)
            .record(prompt_tokens as f64);
    }

    pub fn request_finished(&self, r: FinishedRequest) {
        let l = Labels::Streaming(r.streaming);
        self.counter("sglang:generation_tokens_total", l)
            .increment(r.completion_tokens as u64);
        self.histogram("sglang:generation_tokens_histogram", Labels::Tokenizer)
            .record(r.completion_tokens as f64);
        self.histogram("sglang:e2e_request_latency_seconds", l)
            .record(r.e2e.as_secs_f64());
        if let Some(ttft) = r.ttft {
            self.histogram("sglang:time_to_first_token_seconds", l)
                .record(ttft.as_secs_f64());
            if r.completion_tokens > 1 {
                let tpot =
                    r.e2e.saturating_sub(ttft).as_secs_f64() / (r.completion_tokens - 1) as f64;
                self.histogram("sglang:request_time_per_output_token_seconds", l)
                    .record(tpot);
            }
        }
        self.counter("sglang:cached_tokens_total", Labels::Tokenizer)
            .increment(r.cached_tokens as u64);
        if r.aborted {
            self.counter("sglang:num_aborted_requests_total", Labels::Tokenizer)
                .increment(1);
        }
    }

    pub fn inter_token_latency(&self, gap: Duration, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let per = gap.as_secs_f64() / tokens as f64;
        let h = self.histogram("sglang:inter_token_latency_seconds", Labels::Tokenizer);
        for _ in 0..tokens {
            h.record(per);
        }
    }

    pub fn queue_time(&self, wait: Duration) {
        self.histogram("sglang:queue_time_seconds", Labels::Scheduler)
            .record(wait.as_secs_f64());
    }

    pub fn scheduler_state(
        &self,
        running: usize,
        queued: usize,
        used_tokens: usize,
        capacity: usize,
    ) {
        self.gauge("sglang:num_running_reqs").set(running as f64);
        self.gauge("sglang:num_queue_reqs").set(queued as f64);
        self.gauge("sglang:num_used_tokens").set(used_tokens as f64);
        let usage = if capacity == 0 {
            0.0
        } else {
            used_tokens as f64 / capacity as f64
        };
        self.gauge("sglang:token_usage").set(usage);
    }

    pub fn verify_calls(&self, n: usize) {
        if n > 0 {
            self.counter("sglang:spec_verify_calls_total", Labels::Scheduler)
                .increment(n as u64);
        }
    }

    /// Values over the last decode-log window, as SGLang updates them.
    pub fn decode_window(
        &self,
        gen_throughput: f64,
        accept_length: Option<f64>,
        accept_rate: Option<f64>,
    ) {
        self.gauge("sglang:gen_throughput").set(gen_throughput);
        if let Some(v) = accept_length {
            self.gauge("sglang:spec_accept_length").set(v);
        }
        if let Some(v) = accept_rate {
            self.gauge("sglang:spec_accept_rate").set(v);
        }
    }
}

/// The tokenizer's per-request counters, labelled `is_streaming`.
const STREAMING_COUNTERS: &[&str] = &[
    "sglang:num_requests_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
];

const TOKENIZER_COUNTERS: &[&str] = &[
    "sglang:cached_tokens_total",
    "sglang:num_aborted_requests_total",
];

const GAUGES: &[&str] = &[
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:token_usage",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:spec_accept_length",
    "sglang:spec_accept_rate",
];
