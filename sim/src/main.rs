//! `sglang-sim` binary: one simulated SGLang worker per process.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sglang_sim::config::Config;
use sglang_sim::{bootstrap, server};

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn run(cfg: Config) -> std::io::Result<()> {
    let (listener, bootstrap, cfg) = server::bind(cfg).await?;
    let addr = listener.local_addr()?;
    let drain_timeout = Duration::from_secs_f64(cfg.drain_timeout_s);
    let app = server::App::new(cfg);
    eprintln!(
        "sglang-sim listening on http://{addr} model={} worker_id={} disaggregation_mode={}",
        app.cfg.model,
        app.cfg.worker_id,
        app.cfg.disaggregation_mode.as_str()
    );
    if let Some(b) = bootstrap {
        eprintln!(
            "sglang-sim bootstrap server on {}:{}",
            app.cfg.host, app.cfg.disaggregation_bootstrap_port
        );
        tokio::spawn(bootstrap::serve_bootstrap(b, app.clone()));
    }
    let a = app.clone();
    let srv = tokio::spawn(async move { server::serve(listener, a, std::future::pending()).await });
    shutdown_signal().await;
    // graceful drain: health and new requests answer 503, running requests finish
    app.draining.store(true, Ordering::SeqCst);
    eprintln!("sglang-sim {}: draining", app.cfg.worker_id);
    let drained = server::wait_drained(&app, drain_timeout).await;
    srv.abort();
    eprintln!(
        "sglang-sim {}: {}",
        app.cfg.worker_id,
        if drained {
            "drained, exiting"
        } else {
            "drain timeout, exiting"
        }
    );
    Ok(())
}

fn main() {
    let cfg = match Config::parse(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(msg) => {
            let help = std::env::args().any(|a| a == "--help" || a == "-h");
            eprintln!("{msg}");
            std::process::exit(if help { 0 } else { 2 });
        }
    };
    let rt = if cfg.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads)
            .enable_all()
            .build()
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(run(cfg)) {
        eprintln!("sglang-sim: {e}");
        std::process::exit(1);
    }
}
