//! A kernel launch's argument list, filled in the order of the kernel's parameters. Each
//! kernel's list is written once, by name (`cuda_attn::params`, `device_sample::push_args`),
//! and two launchers take it: cudarc's builder on a GPU and, in tests, the CPU emulation of
//! the kernels, so that the emulation checks the very order a GPU is given.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{LaunchArgs, PushKernelArg};

/// Takes the next argument of a launch.
pub(crate) trait ArgList<A> {
    fn push(&mut self, arg: A);
}

#[cfg(feature = "cuda")]
impl<'a, A> ArgList<A> for LaunchArgs<'a>
where
    Self: PushKernelArg<A>,
{
    fn push(&mut self, arg: A) {
        self.arg(arg);
    }
}
