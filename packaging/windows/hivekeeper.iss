; Inno Setup script for Windows: installs the PyInstaller bundle (dist\hivekeeper\, built on Windows with
; packaging\pyinstaller.spec) into Program Files, with a Start menu entry for the app and `hivekeeper` on the PATH
; of the user who installs it. UNVERIFIED: no Windows machine was available (packaging/README.md).
;   iscc /DAppVersion=0.1.0 packaging\windows\hivekeeper.iss      -> dist\hivekeeper-0.1.0-setup.exe

; the version is pyproject.toml's (the one definition): always passed in, never written here
#ifndef AppVersion
  #error Pass the version: iscc /DAppVersion=<pyproject.toml's version> packaging\windows\hivekeeper.iss
#endif

[Setup]
AppId={{7E0F4C1A-3B52-4C8E-9A57-2D6C1F0B9E21}
AppName=Hivekeeper
AppVersion={#AppVersion}
AppPublisher=Hivekeeper developers
DefaultDirName={autopf}\Hivekeeper
DefaultGroupName=Hivekeeper
OutputDir=..\..\dist
OutputBaseFilename=hivekeeper-{#AppVersion}-setup
Compression=lzma2/max
SolidCompression=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
ChangesEnvironment=yes
PrivilegesRequiredOverridesAllowed=dialog

[Files]
Source: "..\..\dist\hivekeeper\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\Hivekeeper"; Filename: "{app}\hivekeeper.exe"; Parameters: "app"; IconFilename: "{app}\hivekeeper.exe"
Name: "{userstartup}\Hivekeeper node"; Filename: "{app}\hivekeeper.exe"; \
  Parameters: "serve --config ""{userappdata}\hivekeeper\node.json"""; Tasks: nodeatlogin

[Tasks]
Name: nodeatlogin; Description: "Start the swarm node when I log in (reads %APPDATA%\hivekeeper\node.json)"; \
  Flags: unchecked

[Registry]
Root: HKCU; Subkey: "Environment"; ValueType: expandsz; ValueName: "Path"; ValueData: "{olddata};{app}"; \
  Check: NeedsAddPath(ExpandConstant('{app}'))

[Code]
function NeedsAddPath(Dir: string): boolean;
var
  Path: string;
begin
  if not RegQueryStringValue(HKEY_CURRENT_USER, 'Environment', 'Path', Path) then
  begin
    Result := True;
    exit;
  end;
  Result := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Path) + ';') = 0;
end;
