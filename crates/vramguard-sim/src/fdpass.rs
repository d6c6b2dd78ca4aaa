//! Device files handed over a Unix socket (`SCM_RIGHTS`), as CUDA IPC and some serving stacks
//! pass them: the receiver holds `/dev/nvidia*` it never opened, and with them the sender's
//! memory.

use std::fs::File;
use std::io::{Error, ErrorKind, Result};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Most descriptors one message carries.
const MAX_FDS: usize = 16;

/// Serves `files` once on a socket at `path`: the first peer to connect gets them, with this
/// process's pid as the message.
pub fn serve_once(path: &Path, files: Vec<File>, pid: u32) -> Result<()> {
    let listener = UnixListener::bind(path)?;
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        if let Ok((stream, _)) = listener.accept() {
            let fds: Vec<RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
            let _ = send(&stream, &pid.to_ne_bytes(), &fds);
        }
        let _ = std::fs::remove_file(&path);
        // The files stay open in this process too: sending duplicates them.
        std::mem::forget(files);
    });
    Ok(())
}

/// Connects to `path` and receives the sender's pid and files.
pub fn receive(path: &Path) -> Result<(u32, Vec<File>)> {
    let stream = UnixStream::connect(path)?;
    let mut data = [0u8; 4];
    let fds = recv(&stream, &mut data)?;
    Ok((u32::from_ne_bytes(data), fds))
}

fn cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) as usize }
}

fn send(stream: &UnixStream, data: &[u8], fds: &[RawFd]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::new(ErrorKind::InvalidInput, "too many descriptors"));
    }
    let mut control = vec![0u8; cmsg_space()];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr and its control buffer are built as cmsg(3) describes; every pointer
    // outlives the sendmsg call.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
        if libc::sendmsg(stream.as_raw_fd(), &msg, 0) < 0 {
            return Err(Error::last_os_error());
        }
    }
    Ok(())
}

fn recv(stream: &UnixStream, data: &mut [u8]) -> Result<Vec<File>> {
    let mut control = vec![0u8; cmsg_space()];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut files = Vec::new();
    // SAFETY: as in `send`; the descriptors the kernel installed are taken over exactly once.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        if libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) < 0 {
            return Err(Error::last_os_error());
        }
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / size_of::<RawFd>() {
                    files.push(File::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if files.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidData,
            "no descriptors received",
        ));
    }
    Ok(files)
}
