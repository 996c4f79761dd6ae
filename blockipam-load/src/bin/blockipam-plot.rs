//! The blockipam-plot executable: parse, draw, exit (all logic lives in the library).

fn main() {
    let code = blockipam_load::plot::run_plot_cli(
        std::env::args_os(),
        &mut std::io::stdout().lock(),
        &mut std::io::stderr(),
    );
    std::process::exit(code);
}
