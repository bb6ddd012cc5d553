//! The real `dflash-serve` executable on a free loopback port, for tests that must see what a
//! client sees: argument parsing, model loading, warm-up, signals and exit codes included.

use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::TestServer;

/// How long loading the demo pair and the warm-up may take in a debug build on a loaded machine.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);

pub struct ServerProcess {
    child: Option<Child>,
    pub server: TestServer,
    log_path: PathBuf,
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

impl ServerProcess {
    /// Starts `dflash-serve ARGS --host 127.0.0.1 --port P` and waits for SGLang's readiness line
    /// and an HTTP answer on `GET /v1/models` (what bench_serving polls; 401 with --api-key).
    pub async fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[]).await
    }

    /// [`ServerProcess::start`] without `RUST_LOG`, so `--log-level` decides what is logged;
    /// ready once `/v1/models` answers (the readiness line is info-level).
    pub async fn start_without_rust_log(args: &[&str]) -> Self {
        Self::spawn(args, &[], false).await
    }

    /// [`ServerProcess::start`] with extra environment variables for the server.
    pub async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn(args, env, true).await
    }

    async fn spawn(args: &[&str], env: &[(&str, &str)], rust_log: bool) -> Self {
        let port = free_port();
        let log_path = std::env::temp_dir().join(format!(
            "dflash-serve-test-{}-{port}.log",
            std::process::id()
        ));
        let log = std::fs::File::create(&log_path).expect("create the server log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_dflash-serve"));
        command
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        if rust_log {
            command.env("RUST_LOG", "info");
        } else {
            command.env_remove("RUST_LOG");
        }
        let child = command
            .envs(env.iter().copied())
            .stdout(Stdio::from(log.try_clone().expect("log handle")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn dflash-serve");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let mut me = Self {
            child: Some(child),
            server: TestServer { addr },
            log_path,
        };
        me.wait_ready(rust_log).await;
        me
    }

    async fn wait_ready(&mut self, readiness_line: bool) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_exit_status() {
                panic!(
                    "dflash-serve exited during startup ({status}):\n{}",
                    self.log()
                );
            }
            if (!readiness_line
                || self
                    .log()
                    .contains("The server is fired up and ready to roll!"))
                && self.server.try_get("/v1/models").await.is_some()
            {
                return;
            }
            if started.elapsed() > STARTUP_TIMEOUT {
                panic!(
                    "dflash-serve not ready after {STARTUP_TIMEOUT:?}:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Sends SIGTERM, as `docker stop` and Kubernetes do.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            if let Some(s) = self.try_exit_status() {
                return Some(s);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log_path);
        } else {
            eprintln!("server log kept at {}", self.log_path.display());
        }
    }
}

/// Parses one Prometheus sample `name{labels} value` (first match of `name` with `label`).
pub fn metric(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
