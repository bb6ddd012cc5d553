//! dflash-serve: the HTTP server lands with the server issue.
fn main() {
    eprintln!("dflash-serve: not built yet");
    std::process::exit(1);
}
