//! Test support: a deterministic scripted engine (no model) behind the real engine thread and
//! router, served on an ephemeral loopback port, and a minimal HTTP/1.1 client.

#![allow(dead_code)]

pub mod binary;
pub mod hybrid;
pub mod raw;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use dflash_serve::cli::Args;
use dflash_serve::config::ServeConfig;
use dflash_serve::engine::{
    AdmitError, EngineFinish, EngineInfo, EngineRequest, SeqId, StepEngine, StepError, StepEvent,
    TokenLogprob,
};
use dflash_serve::server;
use dflash_serve::state::ModelAssets;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-coder-demo")
}

/// Emits `script` (cycled) `per_step` tokens at a time, like a speculative engine committing a
/// block per verify round; honours `max_new_tokens` and stop ids exactly as the real engine.
pub struct ScriptEngine {
    pub script: Vec<u32>,
    pub per_step: usize,
    seqs: HashMap<SeqId, (EngineRequest, usize)>,
    next: SeqId,
}

impl ScriptEngine {
    pub fn new(script: Vec<u32>, per_step: usize) -> Self {
        Self {
            script,
            per_step,
            seqs: HashMap::new(),
            next: 0,
        }
    }
}

impl StepEngine for ScriptEngine {
    fn add(&mut self, req: EngineRequest) -> Result<SeqId, AdmitError> {
        if req.prompt.contains(&7777) {
            return Err(AdmitError::client(
                "token 7777 is refused by the test engine",
            ));
        }
        if req.prompt.contains(&7778) {
            // What a CUDA out-of-memory while allocating the sequence's cache looks like.
            return Err(AdmitError::server(
                "admitting the request failed: DriverError(CUDA_ERROR_OUT_OF_MEMORY) (test engine)",
            ));
        }
        let id = self.next;
        self.next += 1;
        self.seqs.insert(id, (req, 0));
        Ok(id)
    }

    fn step(&mut self) -> Result<Vec<StepEvent>, StepError> {
        let mut out = Vec::new();
        let mut done = Vec::new();
        let mut ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        ids.sort();
        for id in ids {
            let Some((req, generated)) = self.seqs.get_mut(&id) else {
                continue;
            };
            if req.prompt.contains(&7779) && *generated > 0 {
                // What a device fault in this sequence's forward looks like (the real
                // engine's isolation: tests/tests/step_failures.rs): it alone ends.
                out.push(StepEvent {
                    id,
                    tokens: Vec::new(),
                    finished: None,
                    accepted_drafts: 0,
                    verify_rounds: 0,
                    logprobs: Vec::new(),
                    cached_tokens: 0,
                    retractions: 0,
                    prompt_logprobs: Vec::new(),
                    error: Some(
                        "the model forward failed on the device: injected device fault (test engine)"
                            .into(),
                    ),
                });
                done.push(id);
                continue;
            }
            let mut tokens = Vec::new();
            let mut finished = None;
            while tokens.len() < self.per_step {
                let t = self.script[*generated % self.script.len()];
                tokens.push(t);
                *generated += 1;
                if req.stop_token_ids.contains(&t) {
                    finished = Some(EngineFinish::Stop(t));
                    break;
                }
                if *generated >= req.max_new_tokens {
                    finished = Some(EngineFinish::Length);
                    break;
                }
            }
            let accepted = tokens.len().saturating_sub(1);
            if finished.is_some() {
                done.push(id);
            }
            // Asked-for logprobs are scripted too: token k of the answer has logprob -k/10,
            // and its alternatives are itself then token 0 at -5.
            let first = *generated - tokens.len();
            let logprobs = match req.logprobs {
                None => Vec::new(),
                Some(top) => tokens
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| {
                        let lp = -((first + k) as f32) / 10.0;
                        let alternatives = [(t, lp), (0, -5.0)];
                        TokenLogprob {
                            token: t,
                            logprob: lp,
                            top: alternatives.into_iter().take(top).collect(),
                        }
                    })
                    .collect(),
            };
            out.push(StepEvent {
                id,
                tokens,
                finished,
                accepted_drafts: accepted,
                verify_rounds: 1,
                logprobs,
                cached_tokens: 0,
                retractions: 0,
                error: None,
                prompt_logprobs: Vec::new(),
            });
        }
        for id in done {
            self.seqs.remove(&id);
        }
        Ok(out)
    }

    fn remove(&mut self, id: SeqId) {
        self.seqs.remove(&id);
    }

    fn num_active(&self) -> usize {
        self.seqs.len()
    }

    fn info(&self) -> EngineInfo {
        EngineInfo {
            drafts_per_round: self.per_step.saturating_sub(1),
        }
    }
}

#[derive(Clone)]
pub struct TestServer {
    pub addr: SocketAddr,
}

/// The text the script spells, tokenized with the demo tokenizer, followed by EOS (8188).
pub const SCRIPT_TEXT: &str = "Hello world, this is a test. STOP here\n";

pub async fn start(extra_args: &[&str], per_step: usize) -> TestServer {
    start_with_script(extra_args, per_step, SCRIPT_TEXT).await
}

/// Like [`start`], with the engine spelling `text` (then EOS) instead of [`SCRIPT_TEXT`].
pub async fn start_with_script(extra_args: &[&str], per_step: usize, text: &str) -> TestServer {
    let mut argv = vec!["dflash-serve", "--enable-metrics"];
    argv.extend_from_slice(extra_args);
    let args = Args::try_parse_sglang_from(argv).expect("args");
    let config = ServeConfig::from_args(&args).expect("config");
    let dir = demo_dir();
    let assets = ModelAssets::load(&config, &dir, &dir).expect("assets");
    let mut script = assets.tokenizer.encode(text, false).expect("encode");
    script.push(8188);
    let state =
        server::build_state(config, assets, ScriptEngine::new(script, per_step)).expect("state");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(server::serve(listener, state, std::future::pending()));
    TestServer { addr }
}

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("bad event {e:?}"))
                    .to_string()
            })
            .collect()
    }
}

fn dechunk(raw: &str) -> String {
    let mut out = String::new();
    let mut rest = raw;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

impl TestServer {
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Reply {
        self.try_request(method, path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// Like `request`, but a refused connection or a malformed reply is an `Err`.
    pub async fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Reply, String> {
        let mut s = TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        s.write_all(body).await.map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let raw = String::from_utf8(raw).map_err(|e| format!("reply is not UTF-8: {e}"))?;
        let (headers, body) = raw
            .split_once("\r\n\r\n")
            .ok_or_else(|| format!("no header end in {raw:?}"))?;
        let status = headers
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line in {headers:?}"))?;
        let body = if headers
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        Ok(Reply {
            status,
            headers: headers.to_string(),
            body,
        })
    }

    /// The status of `GET path`, or `None` when nothing answers.
    pub async fn try_get(&self, path: &str) -> Option<u16> {
        self.try_request("GET", path, &[], b"")
            .await
            .ok()
            .map(|r| r.status)
    }

    pub async fn post(&self, path: &str, body: &serde_json::Value) -> Reply {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request("GET", path, &[], b"").await
    }
}

/// Replaces values that change between runs (`created`, latencies) so bodies can be snapshotted.
pub fn normalize(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if matches!(k.as_str(), "created" | "e2e_latency" | "queue_time") {
                    *x = serde_json::json!("<varies>");
                } else {
                    normalize(x);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(normalize),
        _ => {}
    }
}

pub fn normalized_events(r: &Reply) -> String {
    r.events()
        .into_iter()
        .map(|e| match serde_json::from_str::<serde_json::Value>(&e) {
            Ok(mut v) => {
                normalize(&mut v);
                v.to_string()
            }
            Err(_) => e,
        })
        .collect::<Vec<_>>()
        .join("\n")
}
