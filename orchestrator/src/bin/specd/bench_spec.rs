//! `specd bench spec`: filled in below.
use specd_common::model_args::ModelArgs;

#[derive(Debug, clap::Args)]
pub struct SpecBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
}

pub async fn run(_args: SpecBenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
