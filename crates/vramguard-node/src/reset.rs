//! How a GPU is reset: a command (`nvidia-smi --gpu-reset -i {index}` by default, or the
//! admin's `--reset-command`), or a function (the simulator's reset).

use std::sync::Arc;

/// The GPU a reset is for, by every name a reset command may want.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResetTarget {
    /// Index.
    pub index: u32,
    /// UUID, when known.
    pub uuid: Option<String>,
    /// PCI bus id, when known.
    pub pci_bus_id: Option<String>,
}

/// Why a reset failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResetError {
    /// The reset command could not be started.
    #[error("running {command}: {cause}")]
    NotStarted {
        /// The command line.
        command: String,
        /// Why.
        cause: String,
    },
    /// The reset command exited with an error.
    #[error("{command} exited with {status}: {output}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// What it printed.
        output: String,
    },
    /// The reset command gave no answer in time and was killed.
    #[error(
        "{command} gave no answer within {}s and was killed: the GPU may be left mid-reset \
         (check `nvidia-smi` and `dmesg | grep -i -e xid -e nvrm`)",
        .after.as_secs()
    )]
    NoAnswer {
        /// The command line.
        command: String,
        /// How long it was given.
        after: std::time::Duration,
    },
    /// The in-process reset refused (the simulator's, with its reason).
    #[error("{0}")]
    Refused(String),
}

/// A reset done in-process: what it did, or why it failed.
pub type ResetFn = dyn Fn(u32) -> Result<String, ResetError> + Send + Sync;

/// How a GPU is reset.
#[derive(Clone)]
pub enum ResetBackend {
    /// A command, run without a shell; `{index}`, `{uuid}`, `{pci_bus_id}` are replaced.
    Command(Vec<String>),
    /// A function of the GPU index (the simulator's reset).
    Function(Arc<ResetFn>),
}

impl std::fmt::Debug for ResetBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResetBackend::Command(argv) => f.debug_tuple("Command").field(argv).finish(),
            ResetBackend::Function(_) => f.write_str("Function"),
        }
    }
}

impl ResetBackend {
    /// `nvidia-smi --gpu-reset -i {index}`.
    pub fn nvidia_smi() -> ResetBackend {
        ResetBackend::Command(
            ["nvidia-smi", "--gpu-reset", "-i", "{index}"]
                .map(String::from)
                .to_vec(),
        )
    }

    /// Resets `gpu`: `Ok` with what the reset said.
    pub fn reset(&self, gpu: &ResetTarget) -> Result<String, ResetError> {
        match self {
            ResetBackend::Function(reset) => reset(gpu.index),
            ResetBackend::Command(template) => run_reset_command(template, gpu),
        }
    }
}

/// The longest a reset command may take: `nvidia-smi --gpu-reset` takes seconds; one hung on a
/// wedged GPU is killed, and the reset counts as failed.
pub const RESET_COMMAND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// What is kept of a reset command's output.
const RESET_OUTPUT_MAX: u64 = 64 * 1024;

fn run_reset_command(template: &[String], gpu: &ResetTarget) -> Result<String, ResetError> {
    let fill = |arg: &String| {
        arg.replace("{index}", &gpu.index.to_string())
            .replace("{uuid}", gpu.uuid.as_deref().unwrap_or(""))
            .replace("{pci_bus_id}", gpu.pci_bus_id.as_deref().unwrap_or(""))
    };
    let argv: Vec<String> = template.iter().map(fill).collect();
    let command = argv.join(" ");
    let Some((program, args)) = argv.split_first() else {
        return Err(ResetError::NotStarted {
            command,
            cause: "the reset command is empty".into(),
        });
    };
    let out = vramguard_proc::spawn::run_bounded(
        std::process::Command::new(program).args(args),
        RESET_COMMAND_TIMEOUT,
        RESET_OUTPUT_MAX,
    )
    .map_err(|e| command_failure(&command, e))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    if out.status.success() {
        Ok(format!("{command}: {text}"))
    } else {
        Err(ResetError::CommandFailed {
            command,
            status: out.status.to_string(),
            output: text,
        })
    }
}

/// What a reset command that gave no status means.
fn command_failure(command: &str, e: vramguard_proc::spawn::BoundedError) -> ResetError {
    use vramguard_proc::spawn::BoundedError;
    match e {
        BoundedError::Start(e) => ResetError::NotStarted {
            command: command.to_string(),
            cause: e.to_string(),
        },
        BoundedError::Timeout(after) => ResetError::NoAnswer {
            command: command.to_string(),
            after,
        },
        BoundedError::Wait(e) => ResetError::CommandFailed {
            command: command.to_string(),
            status: format!("an unknown status (waiting for it: {e})"),
            output: String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hung reset command read "sleep 600 exited with no answer within 120s: killed: ".
    #[test]
    fn a_reset_command_that_hangs_is_said_to_have_given_no_answer() {
        let e = command_failure(
            "nvidia-smi --gpu-reset -i 0",
            vramguard_proc::spawn::BoundedError::Timeout(std::time::Duration::from_secs(120)),
        );
        assert_eq!(
            e.to_string(),
            "nvidia-smi --gpu-reset -i 0 gave no answer within 120s and was killed: the GPU may \
             be left mid-reset (check `nvidia-smi` and `dmesg | grep -i -e xid -e nvrm`)"
        );
    }

    #[test]
    fn a_reset_command_gets_the_gpu_names_and_its_failure_says_what_ran() {
        let gpu = ResetTarget {
            index: 3,
            uuid: Some("GPU-abc".into()),
            pci_bus_id: Some("00000000:3B:00.0".into()),
        };
        let ok = ResetBackend::Command(
            ["echo", "{index}", "{uuid}", "{pci_bus_id}"]
                .map(String::from)
                .to_vec(),
        );
        assert_eq!(
            ok.reset(&gpu).unwrap(),
            "echo 3 GPU-abc 00000000:3B:00.0: 3 GPU-abc 00000000:3B:00.0"
        );
        let failing = ResetBackend::Command(["false"].map(String::from).to_vec());
        let err = failing.reset(&gpu).unwrap_err();
        assert!(matches!(err, ResetError::CommandFailed { .. }), "{err}");
        let missing = ResetBackend::Command(vec!["/nonexistent/reset".into()]);
        assert!(matches!(
            missing.reset(&gpu).unwrap_err(),
            ResetError::NotStarted { .. }
        ));
    }
}
